"""Soak: many users for a while, some leaving mid-answer, a few asking for another model; afterwards nothing is left.

64 closed-loop clients (each sends its next request when the last one ends) stream greedy answers for --seconds,
against one node or a 2-process ring on loopback (batching on). Prompts run from 30 (the chat template alone is 27) to 1,500 tokens; a quarter of
the requests are cancelled at a random moment (mid-prefill included) by closing the connection; a few ask for a
second model (a random-weight Llama written into each node's EXO_HOME as llama-3.2-1b), which the nodes serve in
turn with SmolLM2. It reports:
- errors other than the cancellations (must be 0);
- greedy divergences: a finished answer that differs from its prompt's solo answer, or a cancelled one that is not a
  prefix of it (must be 0);
- live requests and KV bytes on every node once the clients have stopped, from GET /v1/state (must be 0);
- each node's resident memory at the start, middle and end: flat within 10% or GROWTH_ALLOWANCE_MIB, whichever is
  more, not counting what its prefix cache holds at either end (held to --prefix-cache-mb; its prompts and answers
  are filed from the solo runs on, and a second model's load empties it). The allowance covers the pages a node first
  touches under 64 clients (per-thread tiles, thread stacks: ~25 MiB), which were under 10% of a node that held
  numba's compiler (~330 MiB) but not of one without it (~240 MiB).

  python bench/soak.py --seconds 600              # one node, then a 2-node ring
  python bench/soak.py --seconds 60 --rings 1     # one node only
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import aiohttp
import psutil

sys.path.append(str(Path(__file__).resolve().parent.parent))  # the checkout: exo, and tests.support for the stand-in model

from bench import MODEL, Cluster, make_prompts  # noqa: E402

SECOND_MODEL = "llama-3.2-1b"
PROMPT_TOKENS = [30, 60, 120, 250, 500, 800, 1100, 1500]  # 30: SmolLM2's chat template with its default system prompt is 27
ANSWER_TOKENS = 24
GROWTH_ALLOWANCE_MIB = 32  # resident growth that passes whatever the node's size (see the module's doc)


def prompt_pool(salt: int, lengths: List[int]) -> List[Tuple[str, str]]:
  """(model, prompt): two for the second model, then SmolLM2 prompts of each length (so SmolLM2 is loaded when the
  solo runs end and the soak starts)."""
  second = [(SECOND_MODEL, make_prompts(1, n, salt=salt + 2 * n)[0]) for n in (30, 90)]
  return second + [(MODEL, make_prompts(1, n, salt=salt + n)[0]) for n in lengths]


async def stream(session: aiohttp.ClientSession, url: str, model: str, prompt: str, parts: List[str]) -> Optional[str]:
  """One streamed answer, its text appended to `parts` as it comes; the error message if it failed."""
  body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": ANSWER_TOKENS,
          "temperature": 0.0, "ignore_eos": True}
  async with session.post(url, json=body) as response:
    if response.status != 200:
      return f"HTTP {response.status}: {(await response.text())[:300]}"
    async for line in response.content:
      if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if "error" in chunk:
        return str(chunk["error"].get("message"))
      for choice in chunk.get("choices") or []:
        parts.append((choice.get("delta") or {}).get("content") or "")
  return None


async def node_states(ports: List[int]) -> List[dict]:
  async with aiohttp.ClientSession() as session:
    states = []
    for port in ports:
      async with session.get(f"http://127.0.0.1:{port}/v1/state") as response:
        states.append(await response.json())
    return states


def resident_mib(cluster: Cluster) -> List[float]:
  return [round(psutil.Process(p.pid).memory_info().rss / 2**20, 1) for p in cluster.procs]


async def settled_resident_mib(cluster: Cluster, within_s: float = 5.0) -> List[float]:
  """Resident memory once it has stopped changing: an engine hands its freed heap back just after its last request
  ends, which may be a moment after /v1/state shows nothing left."""
  last, deadline = resident_mib(cluster), time.monotonic() + within_s
  while time.monotonic() < deadline:
    await asyncio.sleep(0.25)
    now = resident_mib(cluster)
    if all(abs(a - b) < 1.0 for a, b in zip(now, last)):
      return now
    last = now
  return last


def prefix_cache_mib(states: List[dict]) -> List[float]:
  """What each node's prefix cache holds on purpose (finished requests' KV, within its budget)."""
  return [round(s.get("prefix_cache", {}).get("bytes", 0) / 2**20, 1) for s in states]


async def soak(cluster: Cluster, args) -> dict:
  seconds, clients, cancel_fraction, second_model_fraction, seed = args.seconds, args.clients, args.cancel_fraction, args.second_model_fraction, args.seed
  pool = prompt_pool(seed, args.prompt_tokens)
  timeout = aiohttp.ClientTimeout(total=1800)
  async with aiohttp.ClientSession(timeout=timeout) as session:
    solo: Dict[Tuple[str, str], str] = {}
    for model, prompt in pool:  # each prompt alone first: the answer every later run of it must give
      parts: List[str] = []
      error = await stream(session, cluster.url, model, prompt, parts)
      if error:
        raise RuntimeError(f"solo run of a {model} prompt failed: {error}")
      solo[(model, prompt)] = "".join(parts)
    memory = {"start": await settled_resident_mib(cluster), "prefix_start": prefix_cache_mib(await node_states(cluster.api_ports))}
    counts = {"requests": 0, "finished": 0, "cancelled": 0, "second_model": 0}
    errors: List[str] = []
    divergences: List[str] = []
    rng = random.Random(seed)
    start = time.monotonic()
    stop_at = start + seconds

    smol, second = [p for p in pool if p[0] == MODEL], [p for p in pool if p[0] == SECOND_MODEL]

    async def client(i: int) -> None:
      asked = 0
      while time.monotonic() < stop_at:
        switch = (i == 0 and asked == 0) or rng.random() < second_model_fraction  # every soak has at least one switch
        model, prompt = rng.choice(second if switch else smol)
        asked += 1
        cancel_after = rng.uniform(0.0, 4.0) if rng.random() < cancel_fraction else None
        parts: List[str] = []
        counts["requests"] += 1
        counts["second_model"] += model == SECOND_MODEL
        task = asyncio.ensure_future(stream(session, cluster.url, model, prompt, parts))
        done, _ = await asyncio.wait([task], timeout=cancel_after)
        if not done:  # the user leaves: the connection closes mid-prefill or mid-answer
          task.cancel()
          await asyncio.gather(task, return_exceptions=True)
          counts["cancelled"] += 1
          if not solo[(model, prompt)].startswith("".join(parts)):
            divergences.append(f"cancelled {model} answer is not a prefix of the solo one: {''.join(parts)!r}")
          continue
        try:
          error = task.result()
        except Exception as e:  # noqa: BLE001 (the soak counts every way a request can fail)
          error = repr(e)
        if error:
          errors.append(error)
        elif "".join(parts) != solo[(model, prompt)]:
          divergences.append(f"{model} answer differs from the solo one: {''.join(parts)!r} vs {solo[(model, prompt)]!r}")
        else:
          counts["finished"] += 1

    async def sample_memory() -> None:
      await asyncio.sleep(seconds / 2)
      memory["middle"] = resident_mib(cluster)

    await asyncio.gather(sample_memory(), *[client(i) for i in range(clients)])
    elapsed = time.monotonic() - start
  # The nodes end the cancelled requests within a prompt chunk; give them a moment, then read what is left.
  deadline, ports = time.monotonic() + 30, cluster.api_ports
  states = await node_states(ports)
  while any(s["requests"] or s["kv_bytes"] for s in states) and time.monotonic() < deadline:
    await asyncio.sleep(0.25)
    states = await node_states(ports)
  memory["end"], memory["prefix_end"] = await settled_resident_mib(cluster), prefix_cache_mib(states)
  grown = [(e - pe) - (s - ps) for s, ps, e, pe in zip(memory["start"], memory["prefix_start"], memory["end"], memory["prefix_end"])]
  growth = [g / (s - ps) for g, s, ps in zip(grown, memory["start"], memory["prefix_start"])]
  return {"nodes": cluster.nodes, "seconds": round(elapsed, 1), "clients": clients, **counts, "errors": len(errors),
          "error_examples": errors[:5], "divergences": len(divergences), "divergence_examples": divergences[:5],
          "live_after": sum(len(s["requests"]) for s in states), "kv_bytes_after": sum(s["kv_bytes"] for s in states),
          "resident_mib": memory, "memory_growth": max(growth),
          "memory_growth_mib": max(grown)}


def install_second_model(home: Path) -> None:
  from tests.support.checkpoints import install_random_model
  previous = os.environ.get("EXO_HOME")
  os.environ["EXO_HOME"] = str(home)
  try:
    install_random_model(SECOND_MODEL)
  finally:
    if previous is None:
      del os.environ["EXO_HOME"]
    else:
      os.environ["EXO_HOME"] = previous


def passed(result: dict) -> bool:
  return (result["errors"] == 0 and result["divergences"] == 0 and result["live_after"] == 0 and result["kv_bytes_after"] == 0
          and (result["memory_growth"] <= 0.10 or result["memory_growth_mib"] <= GROWTH_ALLOWANCE_MIB))


async def main(args) -> int:
  log_dir = Path(args.log_dir or Path(__file__).resolve().parent / "results" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}")
  log_dir.mkdir(parents=True, exist_ok=True)
  results = []
  os.environ["EXO_PREFIX_CACHE_MB"] = f"{args.prefix_cache_mb:g}"  # the nodes' environment is this one's
  for nodes in args.rings:
    for i in range(nodes):
      install_second_model(log_dir / f"home{i}")
    async with Cluster(nodes, args.engine, True, args, log_dir) as cluster:
      result = await soak(cluster, args)
    results.append(result)
    print(json.dumps(result), flush=True)
  with open(log_dir / "soak.jsonl", "a") as out:
    for result in results:
      out.write(json.dumps(result) + "\n")
  print(f"\n{'nodes':>5} {'s':>6} {'requests':>8} {'finished':>8} {'cancelled':>9} {'2nd model':>9} {'errors':>6} {'diverged':>8} "
        f"{'live after':>10} {'KV after':>8} {'RSS start/middle/end (MiB)':>30}")
  for r in results:
    memory = " / ".join(",".join(str(m) for m in r["resident_mib"][k]) for k in ("start", "middle", "end") if k in r["resident_mib"])
    print(f"{r['nodes']:>5} {r['seconds']:>6} {r['requests']:>8} {r['finished']:>8} {r['cancelled']:>9} {r['second_model']:>9} {r['errors']:>6} "
          f"{r['divergences']:>8} {r['live_after']:>10} {r['kv_bytes_after']:>8} {memory:>30}")
  ok = all(passed(r) for r in results)
  print("soak: " + ("passed" if ok else "FAILED"))
  return 0 if ok else 1


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seconds", type=float, default=600)
  p.add_argument("--clients", type=int, default=64)
  p.add_argument("--prompt-tokens", type=lambda s: [int(x) for x in s.split(",")], default=PROMPT_TOKENS, help="the prompt lengths asked for")
  p.add_argument("--rings", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2], help="ring sizes to soak, e.g. 1,2")
  p.add_argument("--cancel-fraction", type=float, default=0.25)
  p.add_argument("--second-model-fraction", type=float, default=0.03)
  p.add_argument("--engine", default="numpy")
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--batch-timeout-ms", type=float, default=5)
  p.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens a step takes beside running streams (a prompt of 1,500 still runs in 12 steps)")
  p.add_argument("--prefix-cache-mb", type=float, default=64, help="EXO_PREFIX_CACHE_MB for the nodes: repeated prompts hit the cache, "
                 "whose memory stays within this (the flat-memory check measures the rest)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-dir", default=None)
  return p.parse_args(argv)


if __name__ == "__main__":
  sys.exit(asyncio.run(main(parse_args())))

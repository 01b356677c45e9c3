"""Prompt prefix reuse: time to first token when a prompt starts the way an earlier one did, cache on and off.

  python bench/prefix.py                 # both cases, 1 node and a 2-node ring, 3 repeats
  python bench/prefix.py --cases chat --rings 1 --repeats 1

Two cases, each run with the prefix cache off (EXO_PREFIX_CACHE=0) and on, taking turns going first:
- chat: one eight-turn conversation, as tinychat holds it: each turn sends the whole conversation so far (about
  150 new prompt tokens a turn, the model's streamed answers of 16 tokens included). Reported: TTFT at each turn,
  the prompt positions each turn took from the cache (GET /v1/state), and turn 8 / turn 1 (target: <= 1.5x with
  the cache, on one node and on the ring), beside the same ratio of the arithmetic each turn did (its new
  positions through the weights, each attending to every position up to its own): what TTFT would show if
  attention ran as fast per FLOP as the weight products. With `llama-server` on PATH it runs beside, on the same
  GGUF, as the reference a user would compare with.
- shared: 16 users whose conversations share one 600-token system prompt, sent at once (N=16), after one
  earlier user's request with that system prompt. Reported: TTFT p50 of the 16 (target: cache on <= 1/3 of off).
Greedy answers must be the same with the cache on and off; the script checks them. Batching is on (16 requests per
step); the ratios compare runs of the same invocation, since this machine's speed drifts over minutes."""
import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import aiohttp

sys.path.append(str(Path(__file__).resolve().parent.parent))

from bench import MODEL, ROOT, WORDS, Cluster, model_arithmetic, pct, stream_one  # noqa: E402
from llama_server import LlamaServer, available  # noqa: E402

TURNS = 8
TURN_WORDS = 120  # about 150 prompt tokens a turn, with the template
ANSWER_TOKENS = 16
SYSTEM_WORDS = 490  # about 600 tokens, with the template
USERS = 16


def text(words: int, salt: int) -> str:
  return " ".join(WORDS[(salt * 7 + i * 3) % len(WORDS)] for i in range(words))


async def ask(session: aiohttp.ClientSession, url: str, messages: List[dict], model: str = MODEL) -> dict:
  result = await stream_one(session, url, "", ANSWER_TOKENS, {"messages": messages, "model": model, "stream_options": {"include_usage": True}})
  return {"ttft": result["times"][0] - result["sent"], "text": result["text"], "prompt_tokens": (result["usage"] or {}).get("prompt_tokens")}


def prefill_flops(m: Dict[str, int], reused: int, new: int) -> float:
  """A prompt's forward pass from position `reused` on: every new row through the layers' weights and attending
  to all positions up to its own, the last one through the head."""
  seen = new * reused + new * (new + 1) // 2
  return 2 * m["layer_weights"] * new + m["attention_per_position"] * seen + 2 * m["head"]


async def reused_positions(session: aiohttp.ClientSession, url: str) -> Optional[int]:
  """Prompt positions the API's node has taken from its prefix cache so far (None: not an exo node, or cache off)."""
  try:
    async with session.get(url.replace("/v1/chat/completions", "/v1/state")) as r:
      return (await r.json())["prefix_cache"].get("reused_positions") if r.status == 200 else None
  except (aiohttp.ClientError, ValueError, KeyError):
    return None


async def chat_case(url: str, salt: int, model: str = MODEL) -> dict:
  """One eight-turn conversation; each turn's answer goes into the next turn's prompt."""
  messages, ttfts, answers, reused, prompts = [], [], [], [], []
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    before = await reused_positions(session, url)
    for turn in range(TURNS):
      messages.append({"role": "user", "content": f"Turn {turn + 1}. Read these words and say what they bring to mind: {text(TURN_WORDS, salt + turn)}"})
      reply = await ask(session, url, messages, model)
      ttfts.append(reply["ttft"])
      answers.append(reply["text"])
      prompts.append(reply["prompt_tokens"])
      messages.append({"role": "assistant", "content": reply["text"]})
      after = await reused_positions(session, url)
      reused.append(None if after is None else after - before)
      before = after
  result = {"ttft": ttfts, "answers": answers, "reused": reused, "prompt_tokens": prompts, "turn8_over_turn1": ttfts[-1] / ttfts[0]}
  if None not in prompts and None not in reused:  # turn 8's arithmetic over turn 1's: what equal rates per FLOP would give
    m = model_arithmetic()
    flops = [prefill_flops(m, r, p - r) for r, p in zip(reused, prompts)]
    result["arithmetic_turn8_over_turn1"] = flops[-1] / flops[0]
  return result


async def shared_case(url: str, salt: int) -> dict:
  system = {"role": "system", "content": f"You are the assistant of the {salt} club. House rules: {text(SYSTEM_WORDS, salt)}"}
  question = lambda i: [system, {"role": "user", "content": f"User {i}: which rule matters most to you, and why? {text(12, salt + i)}"}]
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    earlier = await ask(session, url, question(-1))  # the system prompt has been seen before
    replies = await asyncio.gather(*[ask(session, url, question(i)) for i in range(USERS)])
  ttfts = [r["ttft"] for r in replies]
  return {"ttft": ttfts, "ttft_p50": pct(ttfts, 50), "earlier_ttft": earlier["ttft"], "answers": [r["text"] for r in replies]}


async def run_cluster(args, nodes: int, cache: bool, repeat: int, log_dir: Path) -> Dict[str, dict]:
  os.environ["EXO_PREFIX_CACHE"] = "1" if cache else "0"
  results = {}
  async with Cluster(nodes, args.engine, True, args, log_dir) as cluster:
    async with aiohttp.ClientSession() as session:  # warm-up: load, first allocations
      await ask(session, cluster.url, [{"role": "user", "content": "Hello there."}])
    if "chat" in args.cases:
      results["chat"] = await chat_case(cluster.url, salt=repeat)
    if "shared" in args.cases:
      results["shared"] = await shared_case(cluster.url, salt=repeat)
  return results


def median_turns(runs: List[dict]) -> List[float]:
  return [statistics.median(run["ttft"][t] for run in runs) for t in range(TURNS)]


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--engine", default="numpy")
  p.add_argument("--cases", default="chat,shared")
  p.add_argument("--rings", default="1,2", help="cluster sizes")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  args = p.parse_args()
  args.cases = args.cases.split(",")
  args.batch_size, args.batch_timeout_ms, args.prefill_chunk = USERS, 5.0, None
  log_dir = Path(tempfile.mkdtemp(prefix="exo-prefix-bench-"))
  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  out_path = out_dir / f"prefix-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
  print(f"exo prefix bench: cases {args.cases}, rings {args.rings}, {args.repeats} repeat(s), {os.cpu_count()} CPUs; logs in {log_dir}", flush=True)
  rows = []
  with open(out_path, "w") as out:
    for nodes in [int(n) for n in args.rings.split(",")]:
      for repeat in range(args.repeats):
        for cache in ((False, True) if repeat % 2 == 0 else (True, False)):
          row = {"nodes": nodes, "cache": cache, "repeat": repeat, **await run_cluster(args, nodes, cache, repeat, log_dir)}
          rows.append(row)
          out.write(json.dumps(row) + "\n")
          out.flush()
          parts = [f"{nodes} node(s) cache {'on ' if cache else 'off'} repeat {repeat}"]
          if "chat" in row:
            parts.append("chat TTFT " + " ".join(f"{t:.2f}" for t in row["chat"]["ttft"]) + f" s (turn 8 / 1 = {row['chat']['turn8_over_turn1']:.2f}x)")
            if cache:
              parts.append("positions reused by turn " + " ".join(str(n) for n in row["chat"]["reused"]))
              parts.append("prompt tokens " + " ".join(str(n) for n in row["chat"]["prompt_tokens"]))
          if "shared" in row:
            parts.append(f"shared prompt N={USERS} TTFT p50 {row['shared']['ttft_p50']:.2f} s")
          print("  " + "; ".join(parts), flush=True)
    llama = None
    if "chat" in args.cases and available():
      async with LlamaServer(log_dir) as server:
        llama = [await chat_case(server.url, salt=repeat, model="smollm2") for repeat in range(args.repeats)]
      out.write(json.dumps({"llama_server": llama}) + "\n")

  print("\nmedians over repeats")
  for nodes in sorted({r["nodes"] for r in rows}):
    runs = {cache: [r for r in rows if r["nodes"] == nodes and r["cache"] == cache] for cache in (False, True)}
    same = all(off[case]["answers"] == on[case]["answers"] for off, on in zip(runs[False], runs[True]) for case in args.cases)
    print(f"{nodes} node(s): greedy answers the same with the cache on and off: {same}")
    if "chat" in args.cases:
      for cache in (False, True):
        turns = median_turns([r["chat"] for r in runs[cache]])
        ratios = [r["chat"]["turn8_over_turn1"] for r in runs[cache]]
        print(f"  chat, cache {'on ' if cache else 'off'}: TTFT by turn {' '.join(f'{t:.2f}' for t in turns)} s; "
              f"turn 8 / turn 1 = {statistics.median(ratios):.2f}x (median of {', '.join(f'{x:.2f}x' for x in ratios)})")
        arithmetic = [r["chat"]["arithmetic_turn8_over_turn1"] for r in runs[cache] if "arithmetic_turn8_over_turn1" in r["chat"]]
        if arithmetic:  # the positions each turn computed, counted in FLOPs: the ratio at equal rates per FLOP
          print(f"    the arithmetic of the positions computed, turn 8 / turn 1 = {statistics.median(arithmetic):.2f}x")
    if "shared" in args.cases:
      pairs = [(on["shared"]["ttft_p50"], off["shared"]["ttft_p50"]) for on, off in zip(runs[True], runs[False])]
      ratios = [a / b for a, b in pairs]
      print(f"  shared {SYSTEM_WORDS}-word system prompt, N={USERS}: TTFT p50 off {statistics.median(b for _, b in pairs):.2f} s, "
            f"on {statistics.median(a for a, _ in pairs):.2f} s; on / off = {statistics.median(ratios):.2f} "
            f"(median of {', '.join(f'{x:.2f}' for x in ratios)})")
  if llama:
    turns = median_turns(llama)
    print(f"llama-server: chat TTFT by turn {' '.join(f'{t:.2f}' for t in turns)} s; turn 8 / turn 1 = "
          f"{statistics.median(r['turn8_over_turn1'] for r in llama):.2f}x")
  else:
    print("llama-server: not on PATH, not run")
  print(f"raw figures: {out_path}")


if __name__ == "__main__":
  asyncio.run(main())

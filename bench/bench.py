"""Throughput and latency of exo with batching off and on, measured as docs/benchmark.md describes.

One command starts the server itself (a real `exo` process, or a 2-node ring on loopback), sends N concurrent
streaming requests through the real HTTP API, alternates batching off/on for each repeat, checks that greedy
outputs are identical, prints a table of medians and ratios, and writes JSON lines and a PNG plot.

  python bench/bench.py                       # the full sweep: N = 1..64, 3 repeats, plus ring and interference
  python bench/bench.py --quick               # N = 1, 8, 16, one repeat, 64 tokens
  python bench/bench.py --ns 1,16,64 --off-ns 1,16 --baseline /tmp/exo-main   # also run another checkout's code

Next to tokens/s it prints the model's arithmetic rate (FLOP/s of the generated tokens' forward passes) and the
machine's sgemm peak measured in the same run (bench/products.py), and their ratio.
"""
import argparse
import asyncio
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
WORDS = ("river mountain lantern copper harbor violet meadow thunder pepper canyon orchard marble falcon willow "
         "ember glacier saddle cobalt prairie timber quartz meadowlark basil cedar dune fjord garnet hollow iris").split()


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def make_prompts(n: int, prompt_tokens: int, salt: int = 0) -> List[str]:
  """n different user messages whose chat-templated prompt is exactly prompt_tokens tokens long."""
  from exo.download.shard_download import embedded_model_path
  from exo.inference.tokenizers import resolve_tokenizer
  tokenizer = make_prompts.tokenizer = getattr(make_prompts, "tokenizer", None) or resolve_tokenizer(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
  prompts = []
  for i in range(n):
    words = [f"Story {salt}-{i}: tell me about"]
    k = i * 7
    while True:
      text = " ".join(words)
      length = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}])))
      if length >= prompt_tokens:
        break
      words.append(WORDS[k % len(WORDS)])
      k += 1
    while length > prompt_tokens:  # trim characters until exact
      if not text:
        raise ValueError(f"the chat template alone is longer than {prompt_tokens} tokens")
      text = text[:-1]
      length = len(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}])))
    prompts.append(text)
  return prompts


class Cluster:
  """1 or more `exo` processes on loopback with manual discovery; batching set through the environment."""

  def __init__(self, nodes: int, engine: str, batching: bool, args, log_dir: Path, root: Path = ROOT, placement: Optional[str] = None,
               model: str = MODEL):
    self.nodes, self.engine, self.batching, self.args, self.log_dir, self.root = nodes, engine, batching, args, log_dir, root
    self.model = model  # the nodes' default model: a card's id or a checkpoint's path
    self.placement = placement  # EXO_PLACEMENT for its nodes (None: the nodes' default)
    self.procs: List[subprocess.Popen] = []
    self.api_ports: List[int] = []

  async def __aenter__(self) -> "Cluster":
    grpc_ports = [free_port() for _ in range(self.nodes)]
    self.api_ports = [free_port() for _ in range(self.nodes)]
    config = {"peers": {f"bench{i}": {"address": "127.0.0.1", "port": self.peer_port(i, p), "device_capabilities": {
      "model": "bench", "chip": "cpu", "memory": 1000, "flops": {"fp32": 0, "fp16": 0, "int8": 0}}} for i, p in enumerate(grpc_ports)}}
    config_path = self.log_dir / f"peers-{self.nodes}.json"
    config_path.write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EXO_BATCH", "EXO_PREFILL", "EXO_PLACEMENT"))}
    if self.placement:
      env.update(EXO_PLACEMENT=self.placement)
    if self.batching:
      env.update(EXO_BATCH_SIZE=str(self.args.batch_size), EXO_BATCH_TIMEOUT_MS=str(self.args.batch_timeout_ms))
      if self.args.prefill_chunk is not None:
        env.update(EXO_PREFILL_CHUNK=str(self.args.prefill_chunk))
    for i in range(self.nodes):
      node_env = dict(env, EXO_HOME=str(self.log_dir / f"home{i}"))
      if self.nodes > 1:
        node_env.setdefault("OPENBLAS_NUM_THREADS", "1")  # two nodes on two cores: one thread each
      log = open(self.log_dir / f"node{i}-{'on' if self.batching else 'off'}{'' if self.root == ROOT else '-baseline'}.log", "ab")
      self.procs.append(subprocess.Popen(
        [sys.executable, "-m", "exo.main", "--inference-engine", self.engine, "--disable-tui", "--node-id", f"bench{i}",
         "--node-host", "127.0.0.1", "--node-port", str(grpc_ports[i]), "--chatgpt-api-port", str(self.api_ports[i]),
         "--discovery-module", "manual", "--discovery-config-path", str(config_path), "--max-generate-tokens", "100000",
         "--default-model", self.model], env=node_env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, preexec_fn=self.pin(i)))
    await self._wait_ready()
    return self

  async def _wait_ready(self, limit: float = 180.0) -> None:
    """Until every node sees all of them with the same capabilities: the layer split is computed from those, and
    a node whose view of a peer is still the discovery file's would ask it for other layers (which it refuses); and,
    where the nodes place models, until each has heard every other's facts (all derive the same placement) and every
    group of the default model holds its layers (before that, a router sends everything to the groups that do)."""
    deadline = time.monotonic() + limit
    async with aiohttp.ClientSession() as session:
      while True:
        if any(p.poll() is not None for p in self.procs):
          raise RuntimeError(f"an exo process exited; see logs in {self.log_dir}")
        views = []
        for port in self.api_ports:
          try:
            async with session.get(f"http://127.0.0.1:{port}/v1/topology") as r:
              view = await r.json() if r.status == 200 else None
              placed = (view or {}).get("placement", {})
              placing = placed.get("mode", "off") != "off"
              members = len(placed.get("members", {})) if placing else self.nodes
              loaded = not placing or all(placed.get("models", {}).get(self.model, {}).get("ready", [False]))
              views.append(view["nodes"] if view is not None and members == self.nodes and loaded else None)
          except aiohttp.ClientError:
            views.append(None)
        if all(view is not None and len(view) == self.nodes and view == views[0] for view in views):
          return
        if time.monotonic() > deadline:
          raise RuntimeError(f"cluster not ready after {limit} s; see logs in {self.log_dir}")
        await asyncio.sleep(0.25)

  def peer_port(self, i: int, grpc_port: int) -> int:
    """The port the other nodes reach node i at (bench/machines.py puts a relay there)."""
    return grpc_port

  def pin(self, i: int):
    """What node i's process runs before exo starts (bench/machines.py pins it to its cores)."""
    return None

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.api_ports[0]}/v1/chat/completions"

  @property
  def urls(self) -> List[str]:
    """Every node's chat endpoint (clients spread over the nodes, as behind a load balancer)."""
    return [f"http://127.0.0.1:{port}/v1/chat/completions" for port in self.api_ports]

  async def __aexit__(self, *exc) -> None:
    for p in self.procs:
      p.send_signal(signal.SIGTERM)
    for p in self.procs:
      try:
        p.wait(timeout=20)
      except subprocess.TimeoutExpired:
        p.kill()


async def stream_one(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int, extra: Optional[dict] = None,
                     record: Optional[dict] = None) -> dict:
  """One streaming request; the time of every content chunk as the client sees it (filled into `record` live)."""
  body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": max_tokens,
          "temperature": 0.0, "ignore_eos": True, **(extra or {})}
  record = {} if record is None else record
  sent = record["sent"] = time.perf_counter()
  times = record["times"] = []
  text = record["text_parts"] = []
  usage = None  # with stream_options include_usage: the last chunk's
  async with session.post(url, json=body) as response:
    if response.status != 200:
      raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
    async for line in response.content:
      if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      usage = chunk.get("usage") or usage
      choice = chunk["choices"][0] if chunk.get("choices") else None
      if choice is None:
        continue
      times.append(time.perf_counter())
      text.append((choice.get("delta") or {}).get("content") or "")
  return {"sent": sent, "times": times, "text": "".join(text), "usage": usage}


def pct(values: List[float], q: float) -> float:
  if not values:
    return float("nan")
  values = sorted(values)
  return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarise(results: List[dict]) -> dict:
  first_send = min(r["sent"] for r in results)
  last_token = max(r["times"][-1] for r in results)
  tokens = sum(len(r["times"]) for r in results)
  ttft = [r["times"][0] - r["sent"] for r in results]
  itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
  tpot = [(r["times"][-1] - r["sent"] - (r["times"][0] - r["sent"])) / max(1, len(r["times"]) - 1) for r in results]
  return {"tokens": tokens, "tok_s": tokens / (last_token - first_send), "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
          "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "tpot_p50": pct(tpot, 50)}


async def burst(url, prompts: List[str], max_tokens: int, extra: Optional[List[dict]] = None) -> List[dict]:
  """Every prompt at once, streaming; `url` one endpoint, or a list that the prompts take in turn."""
  urls = [url] if isinstance(url, str) else url
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    return await asyncio.gather(*[stream_one(session, urls[i % len(urls)], p, max_tokens, (extra or [None] * len(prompts))[i]) for i, p in enumerate(prompts)])


async def interference(url: str, streams: int, long_prompt_tokens: int, max_tokens: int) -> dict:
  """While `streams` requests decode, a long prompt arrives: the largest gap each running stream sees vs its median."""
  prompts = make_prompts(streams, 64, salt=7)
  newcomer = make_prompts(1, long_prompt_tokens, salt=9)[0]
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    records = [{} for _ in prompts]
    running = [asyncio.create_task(stream_one(session, url, p, max_tokens, record=r)) for p, r in zip(prompts, records)]
    while not all(len(r.get("times", [])) >= 16 for r in records):  # let every stream reach steady decode
      await asyncio.sleep(0.05)
    arrival = time.perf_counter()
    late = await stream_one(session, url, newcomer, 16)
    done = await asyncio.gather(*running)
  ratios, worst_gap = [], 0.0
  for r in done:
    gaps = [b - a for a, b in zip(r["times"], r["times"][1:])]
    around = [b - a for a, b in zip(r["times"], r["times"][1:]) if b >= arrival]
    if gaps and around:
      ratios.append(max(around) / statistics.median(gaps))
      worst_gap = max(worst_gap, max(around))
  return {"streams": streams, "long_prompt_tokens": long_prompt_tokens, "worst_gap_s": worst_gap,
          "worst_gap_over_median": max(ratios) if ratios else float("nan"), "newcomer_ttft_s": late["times"][0] - late["sent"]}


@functools.lru_cache(maxsize=1)  # parsing the GGUF's metadata takes seconds; the prefix bench asks once a conversation
def model_arithmetic() -> Dict[str, int]:
  """SmolLM2's sizes for counting FLOPs: the layers' weights (norms aside), the head's, and attention's FLOPs per
  position a row sees (4 per head dimension per head per layer: the scores and the weighted sum)."""
  from exo.download.shard_download import embedded_model_path
  from exo.inference.weights import gguf_reader
  reader = gguf_reader(str(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")))
  field = lambda key: reader.fields[key].contents()
  sizes = {t.name: int(np.prod(t.shape)) for t in reader.tensors}
  heads = field("llama.attention.head_count")
  figures = {"layer_weights": sum(n for name, n in sizes.items() if name.startswith("blk.") and name.endswith(".weight") and not name.endswith("norm.weight")),
             "head": sizes.get("output.weight", sizes["token_embd.weight"]),
             "attention_per_position": 4 * field("llama.block_count") * heads * (field("llama.embedding_length") // heads)}
  return figures


def model_flops_per_token(prompt_tokens: int, tokens: int) -> float:
  """The arithmetic of one generated token's forward pass, averaged over a stream: 2 FLOPs per weight of every layer
  and of the head, plus attention at the stream's mean context. The prompt's forward passes are not counted, as in
  the figure the issue quotes."""
  m = model_arithmetic()
  return 2 * (m["layer_weights"] + m["head"]) + m["attention_per_position"] * (prompt_tokens + tokens / 2)


def sgemm_peak() -> float:
  """The machine's float32 sgemm rate, GFLOP/s, measured now in a process of its own (bench/products.py)."""
  output = subprocess.check_output([sys.executable, str(ROOT / "bench" / "products.py"), "--peak"], cwd=ROOT, text=True)
  return float(output.strip().splitlines()[-1])


def print_table(rows: List[dict], ns: List[int], label: str, flops_per_token: Optional[float] = None, peaks: Optional[List[float]] = None) -> None:
  med = lambda rs, k: statistics.median(r[k] for r in rs)
  peak = statistics.median(peaks) if peaks else None
  print(f"\n{label}" + (f"; sgemm peak {peak:.0f} GFLOP/s (median of {', '.join(f'{p:.0f}' for p in peaks)})" if peak else ""))
  print(f"{'N':>4} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7} {'GFLOP/s on':>11} {'of peak':>8} {'TTFT p50 off/on (s)':>20} {'ITL p50 off/on (ms)':>20} {'ITL p99 off/on (ms)':>20} {'same':>5}")
  for n in ns:
    off = [r for r in rows if r["n"] == n and not r["batching"] and not r.get("reference_only")]
    on = [r for r in rows if r["n"] == n and r["batching"]]
    if not on:
      continue
    same = all(r.get("same_as_off", True) for r in on)
    gflops = med(on, "tok_s") * flops_per_token / 1e9 if flops_per_token else float("nan")
    of_peak = f"{100 * gflops / peak:7.0f}%" if peak else f"{'-':>8}"
    field = lambda rs, k, scale=1.0, width=9, fmt=".1f": f"{scale * med(rs, k):>{width}{fmt}}" if rs else f"{'-':>{width}}"
    ratio = f"{med(on, 'tok_s') / med(off, 'tok_s'):>6.2f}x" if off else f"{'-':>7}"
    print(f"{n:>4} {field(off, 'tok_s', width=10)} {med(on, 'tok_s'):>10.1f} {ratio} {gflops:>11.1f} {of_peak} "
          f"{field(off, 'ttft_p50', fmt='.2f')}/{med(on, 'ttft_p50'):<10.2f} {field(off, 'itl_p50', 1000)}/{1000 * med(on, 'itl_p50'):<10.1f} "
          f"{field(off, 'itl_p99', 1000)}/{1000 * med(on, 'itl_p99'):<10.1f} {'yes' if same else 'NO':>5}")


def print_baseline(rows: List[dict], baseline: List[dict], ns: List[int], root: str) -> None:
  med = lambda rs, k: statistics.median(r[k] for r in rs)
  print(f"\nbatching on, this code ÷ the baseline at {root} (each measured next to the other; medians over repeats)")
  print(f"{'N':>4} {'tok/s':>8} {'baseline':>9} {'ratio':>7} {'TTFT p50 (s)':>13} {'baseline':>9} {'ratio':>7} {'same':>5}")
  for n in ns:
    this = [r for r in rows if r["n"] == n and r["batching"]]
    base = [r for r in baseline if r["n"] == n]
    if this and base:
      same = all(r.get("same_as_off", True) for r in base)
      print(f"{n:>4} {med(this, 'tok_s'):>8.1f} {med(base, 'tok_s'):>9.1f} {med(this, 'tok_s') / med(base, 'tok_s'):>6.2f}x "
            f"{med(this, 'ttft_p50'):>13.2f} {med(base, 'ttft_p50'):>9.2f} {med(this, 'ttft_p50') / med(base, 'ttft_p50'):>6.2f}x {'yes' if same else 'NO':>5}")


def plot(rows: List[dict], path: Path) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("(matplotlib not installed: no plot; pip install matplotlib)")
    return
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for nodes in sorted({r["nodes"] for r in rows}):
    for batching in (False, True):
      sel = [r for r in rows if r["nodes"] == nodes and r["batching"] == batching]
      ns = sorted({r["n"] for r in sel})
      if ns:
        ax.plot(ns, [statistics.median(r["tok_s"] for r in sel if r["n"] == n) for n in ns], marker="o",
                label=f"{nodes} node{'s' if nodes > 1 else ''}, batching {'on' if batching else 'off'}")
  ax.set_xscale("log", base=2)
  ax.set_xlabel("concurrent requests (N)")
  ax.set_ylabel("aggregate decode tokens/s")
  ax.set_title("exo, SmolLM2-135M: batching off vs on")
  ax.grid(True, alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


async def sweep(args, nodes: int, ns: List[int], out, log_dir: Path, paired_single: bool = False, peaks: Optional[List[float]] = None) -> List[dict]:
  """Alternating off/on clusters of `nodes` nodes, `args.repeats` times. With `paired_single`, each batching-on
  cluster has a single node measured right before or after it (rows marked "paired"), so that the ring's figure
  is compared with one taken under the same machine load, not minutes earlier on a machine whose speed drifts.
  With `args.baseline`, each batching-on cluster of this code has one of the baseline's code next to it, taking
  turns going first (rows marked "baseline"). Batching off runs at `args.off_ns` only; the first repeat also runs it
  once at the largest N (marked "reference_only") when that is needed to check every output."""
  rows: List[dict] = []
  reference: Dict[int, str] = {}  # prompt index -> the batching-off output (prompt i is the same text whatever N)
  off_ns = [n for n in ns if n in args.off_ns]
  for repeat in range(args.repeats):
    if peaks is not None:
      peaks.append(sgemm_peak())
      print(f"  sgemm peak {peaks[-1]:.0f} GFLOP/s", flush=True)
    for batching in (False, True):
      runs = [(nodes, False, ROOT)]
      if batching and paired_single:
        runs.append((1, True, ROOT))
      if batching and args.baseline:
        runs.append((nodes, False, Path(args.baseline)))
      if repeat % 2:
        runs.reverse()  # take turns going first, so that a drift in the machine's speed favours neither
      for cluster_nodes, paired, root in runs:
        levels = ns if batching else off_ns
        if not batching and repeat == 0 and ns and max(ns) > max(off_ns, default=0):
          levels = off_ns + [max(ns)]
        rows += await measure(args, cluster_nodes, batching, levels, repeat, reference, out, log_dir, paired, root, reference_only=set(levels) - set(off_ns))
  return rows


async def measure(args, nodes: int, batching: bool, ns: List[int], repeat: int, reference: Dict[int, str], out, log_dir: Path,
                  paired: bool = False, root: Path = ROOT, reference_only=()) -> List[dict]:
  """One cluster: a burst of N requests for each N; batching-on outputs are checked against the batching-off ones."""
  rows: List[dict] = []
  code = "this" if root == ROOT else "baseline"
  async with Cluster(nodes, args.engine, batching, args, log_dir, root) as cluster:
    await burst(cluster.url, make_prompts(2, 48, salt=99), 8)  # warm-up: load, first allocations
    for n in ns:
      prompts = make_prompts(n, args.prompt_tokens)
      results = await burst(cluster.url, prompts, args.tokens)
      row = {"nodes": nodes, "n": n, "batching": batching, "repeat": repeat, "engine": args.engine, "code": code, **summarise(results)}
      texts = [r["text"] for r in results]
      if not batching:
        for i, text in enumerate(texts):
          reference.setdefault(i, text)
        if n in reference_only:
          row["reference_only"] = True
      else:
        row["same_as_off"] = all(reference.get(i, text) == text for i, text in enumerate(texts))
      if paired:
        row["paired"] = True
      rows.append(row)
      out.write(json.dumps(row) + "\n")
      out.flush()
      print(f"  {nodes} node(s) {'' if code == 'this' else 'BASELINE '}batching {'on ' if batching else 'off'} N={n:<3} {row['tok_s']:7.1f} tok/s  "
            f"TTFT p50 {row['ttft_p50']:.2f}s  ITL p50 {1000 * row['itl_p50']:.1f}ms" + ("" if not batching else f"  same={row['same_as_off']}")
            + ("  (paired with the ring)" if paired else "") + ("  (reference outputs only)" if row.get("reference_only") else ""), flush=True)
    if batching and args.mixed and nodes == 1 and repeat == 0 and code == "this":
      prompts = make_prompts(8, args.prompt_tokens, salt=3)
      extra = [{"temperature": 0.3 + 0.1 * i, "top_p": 0.9, "seed": i} for i in range(8)]
      results = await burst(cluster.url, prompts, args.tokens, extra)
      row = {"nodes": nodes, "n": 8, "batching": True, "mixed_params": True, **summarise(results)}
      out.write(json.dumps(row) + "\n")
      print(f"  mixed temperatures/top-p, N=8: {row['tok_s']:.1f} tok/s, all {sum(len(r['times']) == args.tokens for r in results)}/8 complete")
  return rows


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--engine", default="numpy")
  p.add_argument("--ns", default="1,2,4,8,16,32,64", help="concurrency levels")
  p.add_argument("--off-ns", default=None, help="levels at which batching off is measured too (default: all of --ns)")
  p.add_argument("--baseline", default=None, help="another checkout of exo whose code runs with batching on next to this one")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--tokens", type=int, default=128, help="generated tokens per request")
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=None, help="EXO_BATCH_SIZE (default: the largest N)")
  p.add_argument("--batch-timeout-ms", type=float, default=5.0)
  p.add_argument("--prefill-chunk", type=int, default=None, help="EXO_PREFILL_CHUNK for the batching runs (default: the node's)")
  p.add_argument("--ring-ns", default="8", help="concurrency levels for the 2-node ring ('' to skip)")
  p.add_argument("--no-interference", dest="interference", action="store_false")
  p.add_argument("--no-mixed", dest="mixed", action="store_false")
  p.add_argument("--quick", action="store_true", help="N = 1, 8, 16; one repeat; 64 tokens")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  args = p.parse_args()
  if args.quick:
    args.ns, args.repeats, args.tokens = "1,8,16", 1, 64
  ns = [int(n) for n in args.ns.split(",") if n]
  ring_ns = [int(n) for n in args.ring_ns.split(",") if n]
  args.off_ns = ns if args.off_ns is None else [int(n) for n in args.off_ns.split(",") if n]
  args.batch_size = args.batch_size or max(ns + ring_ns + [2])
  flops_per_token, peaks = model_flops_per_token(args.prompt_tokens, args.tokens), []
  out_dir = Path(args.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  stamp = time.strftime("%Y%m%d-%H%M%S")
  log_dir = Path(tempfile.mkdtemp(prefix="exo-bench-"))
  print(f"exo bench: engine {args.engine}, N={ns}, {args.repeats} repeat(s), {args.prompt_tokens} prompt + {args.tokens} generated tokens; "
        f"{os.cpu_count()} CPUs; logs in {log_dir}", flush=True)
  with open(out_dir / f"{stamp}.jsonl", "w") as out:
    rows = await sweep(args, 1, ns, out, log_dir, peaks=peaks)
    baseline_rows = [r for r in rows if r["code"] == "baseline"]
    rows = [r for r in rows if r["code"] == "this"]
    ring_args = argparse.Namespace(**{**vars(args), "mixed": False, "baseline": None, "off_ns": ring_ns})
    ring_rows = await sweep(ring_args, 2, ring_ns, out, log_dir, paired_single=True) if ring_ns else []
    paired_rows = [r for r in ring_rows if r.get("paired")]
    ring_rows = [r for r in ring_rows if not r.get("paired")]
    inter: Dict[bool, List[dict]] = {}
    if args.interference:
      for batching in (False, True):
        async with Cluster(1, args.engine, batching, args, log_dir) as cluster:
          await burst(cluster.url, make_prompts(2, 48, salt=99), 8)
          for repeat in range(args.repeats):  # one stall decides a run: quote the median run
            inter.setdefault(batching, []).append(await interference(cluster.url, 7, 512, args.tokens * 2))
            out.write(json.dumps({"interference": True, "batching": batching, "repeat": repeat, **inter[batching][-1]}) + "\n")
  print_table(rows, ns, "1 node (medians over repeats)", flops_per_token, peaks)
  print(f"  (model arithmetic: {flops_per_token / 1e9:.3f} GFLOP per generated token, prompts not counted)")
  if baseline_rows:
    print_baseline(rows, baseline_rows, ns, args.baseline)
  if ring_rows:
    print_table(ring_rows, ring_ns, "2-node ring on loopback")
    for n in ring_ns:
      pairs = [(ring["tok_s"], single["tok_s"]) for ring in ring_rows for single in paired_rows
               if ring["n"] == single["n"] == n and ring["batching"] and ring["repeat"] == single["repeat"]]
      if pairs:
        ratios = [ring / single for ring, single in pairs]
        print(f"  ring ÷ single node, batching on, N={n}: {statistics.median(ratios):.2f}x (median of each ring run ÷ the single node "
              f"run next to it: {', '.join(f'{x:.2f}x' for x in ratios)}; single node {statistics.median(s for _, s in pairs):.1f} tok/s)")
  for batching, runs in inter.items():
    r = sorted(runs, key=lambda run: run["worst_gap_over_median"])[len(runs) // 2]
    every = ", ".join(f"{run['worst_gap_over_median']:.1f}x" for run in runs)
    print(f"prefill interference, batching {'on' if batching else 'off'}: a {r['long_prompt_tokens']}-token prompt among {r['streams']} streams: "
          f"largest gap {1000 * r['worst_gap_s']:.0f} ms = {r['worst_gap_over_median']:.1f}x the median gap (median run of {every}); "
          f"newcomer TTFT {r['newcomer_ttft_s']:.2f} s")
  plot(rows + ring_rows, out_dir / f"{stamp}.png")
  print(f"\nraw figures: {out_dir / (stamp + '.jsonl')}; plot: {out_dir / (stamp + '.png')}")


if __name__ == "__main__":
  asyncio.run(main())

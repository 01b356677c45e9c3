"""A ring of machines against one machine, on one host: each node pinned to its own cores, the single-node baseline
pinned the same way, and the nodes' gRPC links through a loopback relay that delays every byte (bench/relay.py).

  python bench/machines.py                                  # 2 nodes x 1 core, 1 ms each way, N = 1, 16, 32, 3 pairs
  python bench/machines.py --nodes 2 --cores-per-node 1 --hop-delay-ms 1 --ns 1,16,32 --pairs 3 --tokens 64

Each pair runs the ring and the single node one after the other (taking turns going first, so that a drift in the
machine's speed favours neither), both with batching on; every N is a burst of N streaming requests through the
real HTTP API. It prints, per N, ring ÷ single (the median over pairs of each ring run ÷ the single run next to
it), whether greedy outputs were identical, and each stage's busy fraction during the ring's bursts (read from
the nodes' /metrics).

Beside it, the ceiling: what a perfect ring of p stages could reach on these cores (stages of equal cost, free
links, no overhead). It keeps p groups of N/p rows in flight, so each stage runs 1/p of the model p times per cycle
of N tokens: ring ÷ single = T(N) / T(N/p), T(rows) being one whole-model decode step on one node's cores, timed
in a process pinned to them (the sizes' steps taken in turn). Where fewer rows cost nearly as much as more
(weights read from memory, per-step overhead), pipelining cannot pay: T(16) / T(8) is the most a 2-stage ring can
gain at N=16."""
import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import MODEL, ROOT, Cluster, burst, free_port, make_prompts, summarise  # noqa: E402


class Machines(Cluster):
  """Nodes pinned to cores of their own; with a delay, each node reached through a relay of its own."""

  def __init__(self, nodes: int, args, log_dir: Path, root: Path = ROOT):
    super().__init__(nodes, args.engine, True, args, log_dir, root)
    self.relays: List[subprocess.Popen] = []

  def cores(self, i: int) -> set:
    per = self.args.cores_per_node
    return set(range(i * per, (i + 1) * per))

  def pin(self, i: int):
    cores = self.cores(i)
    return lambda: os.sched_setaffinity(0, cores)  # in the child, before exo (and its engine's threads) starts

  def peer_port(self, i: int, grpc_port: int) -> int:
    if self.nodes == 1 or not self.args.hop_delay_ms:
      return grpc_port
    listen = free_port()
    relay = subprocess.Popen([sys.executable, str(ROOT / "bench" / "relay.py"), "--delay-ms", str(self.args.hop_delay_ms), f"{listen}:{grpc_port}"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # it ends when our end of stdin closes
    self.relays.append(relay)
    if relay.stdout.readline().strip() != "ready":
      raise RuntimeError("the relay did not start")
    return listen

  async def __aexit__(self, *exc) -> None:
    await super().__aexit__(*exc)
    for relay in self.relays:
      relay.terminate()
      relay.wait(timeout=10)

  async def scrape(self) -> Dict[str, float]:
    """From every node's /metrics: each stage's busy seconds (by its layers) and its steps and rows so far."""
    from prometheus_client.parser import text_string_to_metric_families
    figures = {}
    async with aiohttp.ClientSession() as session:
      for port in self.api_ports:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
          text = await r.text()
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        layers = [s.labels["layers"] for s in samples if s.name == "exo_stage_busy_seconds_total"]
        for sample in samples:
          if sample.name == "exo_stage_busy_seconds_total":
            figures[f"busy {sample.labels['layers']}"] = sample.value
          elif sample.name in ("exo_batch_size_count", "exo_batch_size_sum") and layers:
            figures[f"{'steps' if sample.name.endswith('count') else 'rows'} {layers[0]}"] = sample.value
    return figures


async def run_cluster(args, nodes: int, ns: List[int], pair: int, out, root: Path = ROOT) -> Dict[int, dict]:
  rows = {}
  async with Machines(nodes, args, Path(args.log_dir), root) as cluster:
    await burst(cluster.url, make_prompts(2, 48, salt=99), 8)  # warm-up: load, first allocations
    for n in ns:
      before, start = await cluster.scrape(), time.monotonic()
      results = await burst(cluster.url, make_prompts(n, args.prompt_tokens), args.tokens)
      wall = time.monotonic() - start
      after = await cluster.scrape()
      moved = {key: value - before.get(key, 0.0) for key, value in after.items()}
      stages = [key[5:] for key in after if key.startswith("busy ")]
      row = {"nodes": nodes, "n": n, "pair": pair, "code": "this" if root == ROOT else str(root), "texts": [r["text"] for r in results], **summarise(results),
             "busy": {layers: moved[f"busy {layers}"] / wall for layers in stages},
             "rows_per_step": {layers: moved.get(f"rows {layers}", 0) / max(1, moved.get(f"steps {layers}", 0)) for layers in stages}}
      rows[n] = row
      out.write(json.dumps({k: v for k, v in row.items() if k != "texts"}) + "\n")
      out.flush()
      busy = ", ".join(f"layers {layers} {100 * b:.0f}% ({row['rows_per_step'][layers]:.1f} rows/step)" for layers, b in sorted(row["busy"].items()))
      print(f"  pair {pair} {nodes} node(s){'' if root == ROOT else ' BASELINE'} N={n:<3} {row['tok_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50']:.2f}s  busy: {busy}", flush=True)
  return rows


async def step_times(sizes: List[int], engine: str, context: int, steps: int = 16) -> Dict[int, float]:
  """Median seconds of one whole-model decode step at each number of rows, on this process's cores: each size its
  own requests (prompts of `context` tokens first), the sizes' steps taken in turn so that drift favours none."""
  from exo.download.shard_download import HFShardDownloader
  from exo.inference.engines import get_inference_engine
  from exo.inference.shard import Shard
  from exo.models import build_base_shard

  e = get_inference_engine(engine, HFShardDownloader())
  layers = build_base_shard(MODEL, type(e).__name__).n_layers
  shard = Shard(MODEL, 0, layers - 1, layers)
  ids = {n: [f"{n}-{i}" for i in range(n)] for n in sizes}
  rng = np.random.default_rng(0)
  for n in sizes:
    await e.infer_batch(shard, [(rid, rng.integers(100, 1000, (1, context)), None) for rid in ids[n]])
  times: Dict[int, List[float]] = {n: [] for n in sizes}
  for i in range(steps + 2):
    for n in (sizes if i % 2 else sizes[::-1]):
      start = time.perf_counter()
      await e.infer_batch(shard, [(rid, np.array([[100 + (i * 7 + j) % 900]]), None) for j, rid in enumerate(ids[n])])
      if i >= 2:  # the first two: allocations, caches warming
        times[n].append(time.perf_counter() - start)
  return {n: statistics.median(t) for n, t in times.items()}


def ceiling(args, ns: List[int]) -> Dict[int, float]:
  """N -> T(N) / T(N / nodes), timed in a child pinned to the first node's cores (see the module's docstring)."""
  ns = [n for n in ns if n >= args.nodes]
  if not ns:
    return {}
  sizes = sorted(set(ns) | {-(-n // args.nodes) for n in ns})
  cores = set(range(args.cores_per_node))
  output = subprocess.check_output([sys.executable, __file__, "--step-times", ",".join(map(str, sizes)), "--engine", args.engine,
                                    "--context", str(args.prompt_tokens + args.tokens // 2)],
                                   cwd=ROOT, text=True, preexec_fn=lambda: os.sched_setaffinity(0, cores))
  times = {int(n): t for n, t in json.loads(output.strip().splitlines()[-1]).items()}
  print(f"  one node's decode step on {len(cores)} core(s): " + ", ".join(f"{n} rows {1e3 * t:.0f} ms" for n, t in sorted(times.items())), flush=True)
  return {n: times[n] / times[-(-n // args.nodes)] for n in ns}


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--engine", default="numpy")
  p.add_argument("--nodes", type=int, default=2)
  p.add_argument("--cores-per-node", type=int, default=1)
  p.add_argument("--hop-delay-ms", type=float, default=1.0, help="one-way delay the relay adds on every link (0: no relay)")
  p.add_argument("--ns", default="1,16,32")
  p.add_argument("--pairs", type=int, default=3)
  p.add_argument("--tokens", type=int, default=64)
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--batch-size", type=int, default=None, help="EXO_BATCH_SIZE (default: the largest N)")
  p.add_argument("--batch-timeout-ms", type=float, default=5.0)
  p.add_argument("--prefill-chunk", type=int, default=None)
  p.add_argument("--baseline", default=None, help="another checkout of exo whose ring runs in each pair too (its ring ÷ the same single node)")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  p.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="skip timing the perfect ring's ceiling")
  p.add_argument("--step-times", default=None, help=argparse.SUPPRESS)  # the ceiling's child: the rows per step to time
  p.add_argument("--context", type=int, default=96, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.step_times:
    print(json.dumps(await step_times([int(n) for n in args.step_times.split(",")], args.engine, args.context)))
    return
  ns = [int(n) for n in args.ns.split(",") if n]
  args.batch_size = args.batch_size or max(ns + [2])
  if args.nodes * args.cores_per_node > len(os.sched_getaffinity(0)):
    raise SystemExit(f"{args.nodes} nodes x {args.cores_per_node} cores need more than this machine's {len(os.sched_getaffinity(0))} cores")
  args.log_dir = tempfile.mkdtemp(prefix="exo-machines-")
  Path(args.out).mkdir(parents=True, exist_ok=True)
  path = Path(args.out) / f"machines-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
  print(f"exo machines bench: {args.nodes} nodes x {args.cores_per_node} core(s), {args.hop_delay_ms:g} ms each way, N={ns}, "
        f"{args.pairs} pair(s), {args.prompt_tokens} prompt + {args.tokens} generated tokens; logs in {args.log_dir}", flush=True)
  pairs, baseline, caps = [], [], []
  with open(path, "w") as out:
    for pair in range(args.pairs):
      if args.ceiling:  # once per pair, so that its median spans the same drift as the rings'
        caps.append(ceiling(args, ns))
        out.write(json.dumps({"pair": pair, "ceiling": caps[-1]}) + "\n")
      order = [(args.nodes, ROOT), (1, ROOT)] + ([(args.nodes, Path(args.baseline))] if args.baseline else [])
      if pair % 2:
        order.reverse()
      runs = {(nodes, root): await run_cluster(args, nodes, ns, pair, out, root) for nodes, root in order}
      pairs.append((runs[(args.nodes, ROOT)], runs[(1, ROOT)]))
      if args.baseline:
        baseline.append(runs[(args.nodes, Path(args.baseline))])
  print(f"\n{args.nodes} nodes x {args.cores_per_node} core(s), {args.hop_delay_ms:g} ms each way, vs 1 node x {args.cores_per_node} core(s); "
        f"medians over {args.pairs} pair(s)")
  print(f"{'N':>4} {'ring tok/s':>11} {'single tok/s':>13} {'ring/single':>12} {'each pair':>24} {'ceiling':>8} {'same':>5}  stage busy (ring)")
  for n in ns:
    ratios = [ring[n]["tok_s"] / single[n]["tok_s"] for ring, single in pairs]
    same = all(ring[n]["texts"] == single[n]["texts"] for ring, single in pairs)
    cap = f"{statistics.median(c[n] for c in caps):7.2f}x" if caps and n in caps[0] else f"{'-':>8}"
    layers = sorted({layers for ring, _ in pairs for layers in ring[n]["busy"]}, key=lambda l: int(l.split("-")[0]))
    busy = ", ".join(f"{l}: {100 * statistics.median(ring[n]['busy'].get(l, 0) for ring, _ in pairs):.0f}%" for l in layers)
    print(f"{n:>4} {statistics.median(r[n]['tok_s'] for r, _ in pairs):>11.1f} {statistics.median(s[n]['tok_s'] for _, s in pairs):>13.1f} "
          f"{statistics.median(ratios):>11.2f}x {' '.join(f'{x:.2f}' for x in ratios):>24} {cap} {'yes' if same else 'NO':>5}  {busy}")
  if caps:
    print(f"  ceiling: a perfect {args.nodes}-stage ring on these cores, T(N) / T(N/{args.nodes}), median over pairs")
  if baseline:
    print(f"\nthe baseline's ring ({args.baseline}) ÷ the same single node")
    for n in ns:
      ratios = [ring[n]["tok_s"] / single[n]["tok_s"] for ring, (_, single) in zip(baseline, pairs)]
      busy = ", ".join(f"{l}: {100 * statistics.median(r[n]['busy'].get(l, 0) for r in baseline):.0f}%" for l in sorted(baseline[0][n]["busy"]))
      print(f"{n:>4} {statistics.median(r[n]['tok_s'] for r in baseline):>11.1f} {statistics.median(ratios):>11.2f}x "
            f"{' '.join(f'{x:.2f}' for x in ratios):>24}  {busy}")
  print(f"\nraw figures: {path}")


if __name__ == "__main__":
  asyncio.run(main())

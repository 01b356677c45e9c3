"""A cluster of machines against one machine, on one host: each node pinned to its own cores, the single-node baseline
pinned the same way, and the nodes' gRPC links through a loopback relay that delays every byte (bench/relay.py).

  python bench/machines.py                                  # 2 nodes x 1 core, 1 ms each way, every placement, 3 pairs
  python bench/machines.py --placements auto --ns 1,16,32,64 --clients spread --conversations 8

Each pair runs, in each placement (EXO_PLACEMENT: auto, the default, places a replica of SmolLM2 on each node;
pipeline, one ring over every node; replicas), a single node and the cluster up at once, all with batching on: every
N is a burst of N streaming requests, run on one and then on the other (which goes first alternates), so that a drift
in the VM's speed (minutes long, tens of percent here) falls on both alike; the one waiting idles. Requests go through
the real HTTP API. Clients: `one` sends every request to the first node's API (it then carries every stream's HTTP
and every remote token), `spread` sends request i to node i mod p (as a load balancer in front of the nodes would).
It prints, per placement and N, cluster ÷ single (the median over pairs of each cluster run ÷ the single run of its
pair), whether greedy outputs were identical to one unbatched node's (run once, before the pairs, pinned the same
way), each stage's busy fraction (from the nodes' /metrics), and:

- the ceiling: what p nodes that each take N/p of the streams could reach on these cores, T(N) / T(N/p), T(rows)
  being one whole-model decode step on one node's cores, timed in a process pinned to them (the sizes' steps taken
  in turn). Replicas and a perfect p-stage pipeline share it. Beside it, the share of the ceiling reached. That
  T(N/p) is timed with the other cores idle; the nodes of a cluster compute at once and share the host's memory bus
  and caches, so the bench also times T(N/p) in p processes stepping at once, one on each node's cores ("busy"), and
  prints that ceiling and its share too: what is left between the cluster and it is the cluster's own cost; and
  beside each ITL p50 (cluster/single) the bare engine step at the same rows ("step c/s": a replica's N/p rows stepped
  with every node's cores busy, the single node's N rows alone), so that the time between tokens spent outside the
  engine shows, and where it goes: each node's event-loop core time a step ("loop ms/step", the work beside its
  engine's thread on the same cores) and, per burst, the share of a core the clients and the relays took;
- capacity: the most streams whose inter-token latency p50 stays within the single node's at N=16, for the single
  node and for the cluster, among the Ns run and the extra bursts of --capacity-ns (near twice 16, where two nodes
  should land).

With --conversations C, each cluster in `auto` and the single node also hold C conversations of --turns turns at once
(each turn the whole conversation so far, as a chat client sends it; every conversation takes its turn k together):
reported are the later turns that the router sent to the group holding their prefix (its /metrics, reason "prefix"),
the prompt positions the engines' prefix caches spared the later turns (/v1/state), cluster ÷ single (1.00: every
turn found its prefix where it landed), and turn 8 / turn 1 time to first token, cluster beside single."""
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
from typing import Dict, List, Optional, Tuple

import aiohttp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import MODEL, ROOT, WORDS, Cluster, burst, free_port, make_prompts, stream_one, summarise  # noqa: E402

CAPACITY_AT = 16  # the single node's ITL p50 at this many streams is the latency capacity keeps within


def node_cores(args, i: int) -> set:
  """The cores node i is pinned to."""
  return set(range(i * args.cores_per_node, (i + 1) * args.cores_per_node))


class Machines(Cluster):
  """Nodes pinned to cores of their own; with a delay, each node reached through a relay of its own."""

  def __init__(self, nodes: int, args, log_dir: Path, root: Path = ROOT, placement: Optional[str] = None, batching: bool = True):
    super().__init__(nodes, args.engine, batching, args, log_dir, root, placement)
    self.relays: List[subprocess.Popen] = []

  def cores(self, i: int) -> set:
    return node_cores(self.args, i)

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
    """From every node's /metrics: each stage's busy seconds (by its layers), its steps and rows so far, and the
    requests it routed, by reason."""
    from prometheus_client.parser import text_string_to_metric_families
    figures = {}
    async with aiohttp.ClientSession() as session:
      for i, port in enumerate(self.api_ports):
        async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
          text = await r.text()
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        layers = [s.labels["layers"] for s in samples if s.name == "exo_stage_busy_seconds_total"]
        for sample in samples:
          if sample.name == "exo_stage_busy_seconds_total":
            figures[f"busy {i}:{sample.labels['layers']}"] = sample.value
          elif sample.name in ("exo_batch_size_count", "exo_batch_size_sum") and layers:
            figures[f"{'steps' if sample.name.endswith('count') else 'rows'} {i}:{layers[0]}"] = sample.value
          elif sample.name == "exo_routed_requests_total":
            figures[f"routed {sample.labels['reason']}"] = figures.get(f"routed {sample.labels['reason']}", 0.0) + sample.value
    return figures

  async def reused_positions(self) -> int:
    """Prompt positions the nodes' prefix caches have spared so far (each node's /v1/state), summed."""
    total = 0
    async with aiohttp.ClientSession() as session:
      for port in self.api_ports:
        async with session.get(f"http://127.0.0.1:{port}/v1/state") as r:
          total += (await r.json())["prefix_cache"].get("reused_positions", 0)
    return total


def run_label(placement: Optional[str], clients: str, root: Path) -> str:
  """A cluster configuration's name in the tables: its placement and clients, `baseline` for another checkout's ring."""
  if root != ROOT:
    return f"baseline{'-' + placement if placement else ''}/{clients}"
  return f"{placement or 'baseline'}/{clients}"


def clients_of(cluster: Cluster, clients: str):
  return cluster.url if clients == "one" else cluster.urls


async def one_burst(cluster: Machines, urls, n: int, args, label: str, pair: int, out, idle: List[subprocess.Popen]) -> Dict:
  """A burst of n streams on one configuration, with its stages' busy fractions and each node's event-loop core time a
  step (see loop_seconds); also the core time that the configuration waiting meanwhile (`idle`) took, which should be
  next to none, and that this process (the clients) and the relays took, which the nodes' cores share."""
  before, start, idle_before = await cluster.scrape(), time.monotonic(), sum(map(cpu_seconds, idle))
  loops_before, harness_before = [loop_seconds(p) for p in cluster.procs], harness_seconds(cluster)
  results = await burst(urls, make_prompts(n, args.prompt_tokens), args.tokens)
  wall = time.monotonic() - start
  loops, harness_used = [loop_seconds(p) - b for p, b in zip(cluster.procs, loops_before)], harness_seconds(cluster) - harness_before
  after = await cluster.scrape()
  moved = {key: value - before.get(key, 0.0) for key, value in after.items()}
  stages = [key[5:] for key in after if key.startswith("busy ")]
  steps = [sum(v for k, v in moved.items() if k.startswith(f"steps {i}:")) for i in range(cluster.nodes)]
  row = {"label": label, "nodes": cluster.nodes, "n": n, "pair": pair, "code": "this" if cluster.root == ROOT else str(cluster.root),
         "texts": [r["text"] for r in results], **summarise(results), "busy": {stage: moved[f"busy {stage}"] / wall for stage in stages},
         "rows_per_step": {stage: moved.get(f"rows {stage}", 0) / max(1, moved.get(f"steps {stage}", 0)) for stage in stages},
         "loop_s_per_step": [used / max(1, count) for used, count in zip(loops, steps)],
         "harness": harness_used / wall, "idle_other": (sum(map(cpu_seconds, idle)) - idle_before) / wall}
  out.write(json.dumps({k: v for k, v in row.items() if k != "texts"}) + "\n")
  out.flush()
  busy = ", ".join(f"{stage} {100 * b:.0f}% ({row['rows_per_step'][stage]:.1f} rows/step)" for stage, b in sorted(row["busy"].items()))
  loop = " ".join(f"{i}:{1e3 * t:.1f}" for i, t in enumerate(row["loop_s_per_step"]))
  print(f"  pair {pair} {label:<16} N={n:<3} {row['tok_s']:7.1f} tok/s  TTFT p50 {row['ttft_p50']:.2f}s  ITL p50 {1e3 * row['itl_p50']:.0f} ms  "
        f"busy: {busy}; event loop ms/step {loop}; clients and relays {100 * row['harness']:.0f}% of a core; "
        f"the other side idle: {100 * row['idle_other']:.1f}% of a core", flush=True)
  return row


def cpu_seconds(process: subprocess.Popen) -> float:
  """Core seconds a process has used so far (user + system)."""
  return _stat_seconds(f"/proc/{process.pid}/stat")


def loop_seconds(process: subprocess.Popen) -> float:
  """Core seconds a node's main thread, its event loop, has used so far: the work beside its engine's thread (sampling,
  the step's output, statuses, HTTP streams), which on a node of one core lengthens every step by as much."""
  return _stat_seconds(f"/proc/{process.pid}/task/{process.pid}/stat")


def harness_seconds(cluster: "Machines") -> float:
  """Core seconds this process (the clients) and the cluster's relays have used so far."""
  own = os.times()
  return own.user + own.system + sum(map(cpu_seconds, cluster.relays))


def _stat_seconds(path: str) -> float:
  with open(path) as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_pair(args, placement: Optional[str], clients: str, ns: List[int], pair: int, out, root: Path = ROOT) -> Tuple[Dict, Dict]:
  """One pair: a single node and a cluster up at once, each burst run on one and then on the other (which goes first
  alternates), so that a drift in the machine's speed, minutes long on a shared VM, falls on both alike. The one
  waiting idles; its core time is printed beside each burst. Returns (cluster's rows, single node's rows) by N."""
  label = run_label(placement, clients, root)
  log_dir = Path(args.log_dir) / f"pair{pair}-{label.replace('/', '-')}"
  (log_dir / "single").mkdir(parents=True, exist_ok=True)
  (log_dir / "cluster").mkdir(parents=True, exist_ok=True)
  async with Machines(1, args, log_dir / "single") as single, Machines(args.nodes, args, log_dir / "cluster", root, placement) as cluster:
    sides = {"single": (single, single.url), label: (cluster, clients_of(cluster, clients))}
    rows: Dict[str, Dict] = {"single": {}, label: {}}
    for side, _ in sides.values():
      await burst(side.urls, make_prompts(2 * side.nodes, 48, salt=99), 8)  # warm-up at every node: loads, first allocations
    for i, n in enumerate(ns + [n for n in args.capacity_ns if n not in ns]):
      order = list(sides) if (i + pair) % 2 == 0 else list(sides)[::-1]
      for name in order:
        side, urls = sides[name]
        other = sides["single" if name == label else label][0]
        rows[name][n] = await one_burst(side, urls, n, args, name, pair, out, other.procs)
    if args.conversations and placement in (None, "auto"):
      for name in (list(sides) if pair % 2 == 0 else list(sides)[::-1]):
        side, _ = sides[name]
        c = rows[name]["conversations"] = await conversations(side, args, clients if name == label else "one")
        out.write(json.dumps({"label": name, "pair": pair, "conversations": c}) + "\n")
        print(f"  pair {pair} {name:<16} {args.conversations} conversations x {args.turns} turns: TTFT by turn "
              f"{' '.join(f'{t:.2f}' for t in c['ttft_by_turn'])} s, turn {args.turns} / 1 = {c['last_over_first']:.2f}x"
              + (f", later turns routed to their prefix's group {100 * c['prefix_share']:.0f}%" if c["prefix_share"] is not None else ""), flush=True)
  return rows[label], rows["single"]


def words(count: int, salt: int) -> str:
  return " ".join(WORDS[(salt * 7 + i * 3) % len(WORDS)] for i in range(count))


async def conversations(cluster: Machines, args, clients: str) -> dict:
  """C conversations at once, turn by turn: each turn sends the whole conversation so far."""
  urls = [cluster.url] if clients == "one" else cluster.urls
  histories = [[] for _ in range(args.conversations)]
  ttft, answers, routed, reused = [[] for _ in range(args.turns)], [], {"prefix": 0.0, "total": 0.0}, 0
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    for turn in range(args.turns):
      before, reused_before = await cluster.scrape(), await cluster.reused_positions()
      for c, history in enumerate(histories):
        history.append({"role": "user", "content": f"Conversation {c}, turn {turn + 1}: what do these words bring to mind? {words(60, c * 31 + turn)}"})
      replies = await asyncio.gather(*[stream_one(session, urls[c % len(urls)], "", args.answer_tokens, {"messages": history})
                                       for c, history in enumerate(histories)])
      after, reused_after = await cluster.scrape(), await cluster.reused_positions()
      for history, reply in zip(histories, replies):
        history.append({"role": "assistant", "content": reply["text"]})
        ttft[turn].append(reply["times"][0] - reply["sent"])
      answers.append([r["text"] for r in replies])
      if turn:
        reused += reused_after - reused_before
        routed["prefix"] += after.get("routed prefix", 0.0) - before.get("routed prefix", 0.0)
        routed["total"] += sum(after.get(k, 0.0) - before.get(k, 0.0) for k in after if k.startswith("routed "))
  by_turn = [statistics.median(t) for t in ttft]
  return {"ttft_by_turn": by_turn, "last_over_first": by_turn[-1] / by_turn[0], "answers": answers, "reused_positions": reused,
          "prefix_share": routed["prefix"] / routed["total"] if routed["total"] else None}


async def unbatched_reference(args, ns: List[int]) -> Dict:
  """The greedy outputs of one node with batching off, pinned to the first node's cores: the burst prompts' texts (prompt
  i is the same text whatever N) and, with --conversations, the conversations' answers. Every run must equal them."""
  async with Machines(1, args, Path(args.log_dir), batching=False) as node:
    results = await burst(node.url, make_prompts(max(ns + args.capacity_ns), args.prompt_tokens), args.tokens)
    reference = {"texts": [r["text"] for r in results]}
    if args.conversations:
      reference["answers"] = (await conversations(node, args, "one"))["answers"]
  print(f"  one unbatched node: {len(results)} prompts" + (f", {args.conversations} conversations" if args.conversations else "") + " answered", flush=True)
  return reference


async def step_times(sizes: List[int], engine: str, context: int, steps: int = 16, wait_for_go: bool = False) -> Dict[int, float]:
  """Median seconds of one whole-model decode step at each number of rows, on this process's cores: each size its
  own requests (prompts of `context` tokens first), the sizes' steps taken in turn so that drift favours none. With
  wait_for_go, the steps start when a line arrives on stdin (after "ready" on stdout), so that processes on other
  cores time theirs at the same moment."""
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
  if wait_for_go:
    print("ready", flush=True)
    sys.stdin.readline()
  times: Dict[int, List[float]] = {n: [] for n in sizes}
  for i in range(steps + 2):
    for n in (sizes if i % 2 else sizes[::-1]):
      start = time.perf_counter()
      await e.infer_batch(shard, [(rid, np.array([[100 + (i * 7 + j) % 900]]), None) for j, rid in enumerate(ids[n])])
      if i >= 2:  # the first two: allocations, caches warming
        times[n].append(time.perf_counter() - start)
  return {n: statistics.median(t) for n, t in times.items()}


def timed_steps(args, sizes: List[int], nodes: List[int]) -> List[Dict[int, float]]:
  """step_times in one child per node, each pinned to that node's cores, all stepping at once."""
  children = []
  for i in nodes:
    cores = node_cores(args, i)
    children.append(subprocess.Popen([sys.executable, __file__, "--step-times", ",".join(map(str, sizes)), "--engine", args.engine,
                                      "--context", str(args.prompt_tokens + args.tokens // 2), "--wait-for-go"],
                                     cwd=ROOT, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores)))
  for child in children:  # every child has loaded the model and filled its caches before any times a step
    if not any(line.strip() == "ready" for line in iter(child.stdout.readline, "")):
      raise SystemExit(f"a step timer stopped before it was ready (exit {child.wait()})")
  for child in children:
    child.stdin.write("go\n")
    child.stdin.flush()
  results = []
  for child in children:
    output, _ = child.communicate()
    if child.returncode:
      raise SystemExit(f"the step timer failed (exit {child.returncode})")
    results.append({int(n): t for n, t in json.loads(output.strip().splitlines()[-1]).items()})
  return results


def ceiling(args, ns: List[int]) -> Dict[str, Dict[int, float]]:
  """{"idle": N -> T(N) / T(N / nodes), T timed on the first node's cores with the others idle; "busy": the same with
  T(N / nodes) timed on every node's cores at once (the median over the nodes); "steps_busy": rows -> those steps'
  seconds; "step_alone": rows -> the first's} (see the module's docstring). The capacity bursts' shares are timed too."""
  ns = [n for n in ns if n >= args.nodes]
  if not ns:
    return {"idle": {}, "busy": {}, "steps_busy": {}, "step_alone": {}}
  shares = sorted({-(-n // args.nodes) for n in ns + args.capacity_ns})
  [alone] = timed_steps(args, sorted(set(ns) | set(shares)), [0])
  together = timed_steps(args, shares, list(range(args.nodes)))
  busy = {n: statistics.median(times[n] for times in together) for n in shares}
  print(f"  one node's decode step on {args.cores_per_node} core(s), the others idle: "
        + ", ".join(f"{n} rows {1e3 * t:.0f} ms" for n, t in sorted(alone.items()))
        + f"; with all {args.nodes} nodes' cores stepping at once: " + ", ".join(f"{n} rows {1e3 * t:.0f} ms" for n, t in sorted(busy.items())), flush=True)
  return {"idle": {n: alone[n] / alone[-(-n // args.nodes)] for n in ns}, "busy": {n: alone[n] / busy[-(-n // args.nodes)] for n in ns},
          "steps_busy": busy, "step_alone": alone}


def host_capacity(args, ns: List[int], cap: Dict[str, Dict[int, float]]) -> int:
  """Among the bursts run, the most streams N whose share N / nodes, stepped on every node's cores at once, takes no
  longer than one node's CAPACITY_AT-row step alone: the most a cluster of these cores could hold at that latency."""
  limit = cap["step_alone"][CAPACITY_AT]
  return max((n for n in ns + args.capacity_ns if cap["steps_busy"].get(-(-n // args.nodes), float("inf")) <= limit), default=0)


def capacity(rows: Dict, limit: float) -> int:
  """The most streams whose ITL p50 stays within `limit`, among the bursts run (0 if none does)."""
  return max((n for n, row in rows.items() if isinstance(n, int) and row["itl_p50"] <= limit), default=0)


def stage_busy(pairs: List[Tuple[Dict, Dict]], n: int) -> Dict[str, Tuple[List[str], List[float]]]:
  """Each cluster node's layers (a pair's cut may differ from another's: speeds are measured at each start) and its busy
  fraction in each pair."""
  nodes: Dict[str, Tuple[List[str], List[float]]] = {}
  for cluster, _ in pairs:
    for stage, fraction in cluster[n]["busy"].items():
      node, layers = stage.split(":", 1)
      seen, fractions = nodes.setdefault(node, ([], []))
      seen.extend([layers] if layers not in seen else [])
      fractions.append(fraction)
  return dict(sorted(nodes.items()))


def same_as(reference: Dict, rows: Dict, ns: List[int]) -> bool:
  """Whether a run's greedy outputs (every burst, and the conversations if it held them) equal one unbatched node's."""
  bursts = all(rows[n]["texts"] == reference["texts"][:n] for n in ns + [n for n in rows if isinstance(n, int) and n not in ns])
  return bursts and ("conversations" not in rows or rows["conversations"]["answers"] == reference.get("answers"))


def report(args, ns: List[int], runs: List[Dict], caps: List[Dict[str, Dict[int, float]]], reference: Dict) -> None:
  """The tables, medians over pairs: each cluster configuration against the single node of the same pair."""
  for label in runs[0]:
    pairs = [run[label] for run in runs]
    print(f"\n{label}: {args.nodes} nodes x {args.cores_per_node} core(s), {args.hop_delay_ms:g} ms each way, vs 1 node x {args.cores_per_node} "
          f"core(s); medians over {len(pairs)} pair(s)")
    print(f"{'N':>4} {'cluster tok/s':>14} {'single tok/s':>13} {'cluster/single':>15} {'each pair':>20} {'ceiling':>8} {'of ceiling':>11} {'busy: ceiling, of it':>21} "
          f"{'ITL p50 c/s (ms)':>17} {'step c/s (ms)':>14} {'loop ms/step c | s':>19} {'same':>5}  stage busy (cluster)   (same: greedy outputs as one unbatched node's; "
          f"loop: each node's event-loop core time per step, cluster nodes | the single node)")
    for n in ns:
      ratios = [cluster[n]["tok_s"] / single[n]["tok_s"] for cluster, single in pairs]
      ratio = statistics.median(ratios)
      same = all(cluster[n]["texts"] == reference["texts"][:n] for cluster, _ in pairs)
      cap, cap_busy = (statistics.median(c[kind][n] for c in caps) if caps and n in caps[0][kind] else None for kind in ("idle", "busy"))
      share = f"{100 * ratio / cap:10.0f}%" if cap else f"{'-':>11}"
      share_busy = f"{cap_busy:6.2f}x {100 * ratio / cap_busy:4.0f}%" if cap_busy else f"{'-':>12}"
      itl = f"{1e3 * statistics.median(c[n]['itl_p50'] for c, _ in pairs):.0f}/{1e3 * statistics.median(s[n]['itl_p50'] for _, s in pairs):.0f}"
      steps = (f"{1e3 * statistics.median(c['steps_busy'][-(-n // args.nodes)] for c in caps):.0f}/{1e3 * statistics.median(c['step_alone'][n] for c in caps):.0f}"
               if caps and n in caps[0]["step_alone"] else "-")
      busy = ", ".join(f"{node}:{'/'.join(layers)}: {100 * statistics.median(fractions):.0f}%" for node, (layers, fractions) in stage_busy(pairs, n).items())
      loops = [" ".join(f"{1e3 * statistics.median(side[n]['loop_s_per_step'][i] for side in sides):.1f}" for i in range(len(sides[0][n]["loop_s_per_step"])))
               for sides in ([c for c, _ in pairs], [s for _, s in pairs])]
      print(f"{n:>4} {statistics.median(c[n]['tok_s'] for c, _ in pairs):>14.1f} {statistics.median(s[n]['tok_s'] for _, s in pairs):>13.1f} "
            f"{ratio:>14.2f}x {' '.join(f'{x:.2f}' for x in ratios):>20} {(f'{cap:7.2f}x' if cap else '-'):>8} {share} {share_busy:>21} {itl:>17} {steps:>14} {' | '.join(loops):>19} {'yes' if same else 'NO':>5}  {busy}")
    if CAPACITY_AT in ns:
      cluster_capacity, single_capacity = [], []
      for cluster, single in pairs:
        limit = single[CAPACITY_AT]["itl_p50"]
        cluster_capacity.append(capacity(cluster, limit))
        single_capacity.append(capacity(single, limit))
      c, s = statistics.median(cluster_capacity), statistics.median(single_capacity)
      print(f"  capacity (ITL p50 within the single node's at N={CAPACITY_AT}): single {s:g} streams, cluster {c:g} streams "
            f"({c / s if s else float('nan'):.2f}x; each pair {', '.join(f'{a}/{b}' for a, b in zip(cluster_capacity, single_capacity))})")
      if caps and CAPACITY_AT in caps[0]["step_alone"]:
        bounds = [host_capacity(args, ns, cap) for cap in caps]
        print(f"  host bound on capacity: the most streams whose share, stepped on every node's cores at once, takes no longer than one node's "
              f"{CAPACITY_AT}-row step alone: {statistics.median(bounds):g} streams (each pair {', '.join(map(str, bounds))})")
    conv = [(cluster.get("conversations"), single.get("conversations")) for cluster, single in pairs]
    if all(a and b for a, b in conv):
      shares = [a["prefix_share"] for a, _ in conv if a["prefix_share"] is not None]
      reuse = [a["reused_positions"] / b["reused_positions"] if b["reused_positions"] else float("nan") for a, b in conv]
      print(f"  {args.conversations} conversations x {args.turns} turns: later turns routed to the group holding their prefix "
            f"{100 * statistics.median(shares):.0f}% (each pair {', '.join(f'{100 * x:.0f}%' for x in shares)}); their positions spared by "
            f"prefix caches, cluster ÷ single {statistics.median(reuse):.2f}; turn {args.turns} / turn 1 TTFT "
            f"cluster {statistics.median(a['last_over_first'] for a, _ in conv):.2f}x, single {statistics.median(b['last_over_first'] for _, b in conv):.2f}x; "
            f"answers as one unbatched node's: {'yes' if all(a['answers'] == reference.get('answers') for a, _ in conv) else 'NO'}")
  print(f"\n  single node (batched): greedy outputs as one unbatched node's: {'yes' if all(same_as(reference, single, ns) for run in runs for _, single in run.values()) else 'NO'}")
  if caps:
    print(f"\n  ceiling: {args.nodes} nodes each taking N/{args.nodes} of the streams on these cores, T(N) / T(N/{args.nodes}), median over pairs;"
          f" busy: T(N/{args.nodes}) timed on every node's cores at once")


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--engine", default="numpy")
  p.add_argument("--nodes", type=int, default=2)
  p.add_argument("--cores-per-node", type=int, default=1)
  p.add_argument("--hop-delay-ms", type=float, default=1.0, help="one-way delay the relay adds on every link (0: no relay)")
  p.add_argument("--placements", default="auto,pipeline,replicas", help="EXO_PLACEMENT of the cluster runs, comma-separated")
  p.add_argument("--clients", default="one", help="one: every request to the first node's API; spread: request i to node i mod p; or both")
  p.add_argument("--ns", default="1,16,32,64")
  p.add_argument("--capacity-ns", default="24,30", help="extra bursts for capacity only (not in the table)")
  p.add_argument("--pairs", type=int, default=3)
  p.add_argument("--tokens", type=int, default=64)
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--conversations", type=int, default=0, help="conversations held at once (auto placement and the single node)")
  p.add_argument("--turns", type=int, default=8)
  p.add_argument("--answer-tokens", type=int, default=16, help="tokens of each conversation turn's answer")
  p.add_argument("--batch-size", type=int, default=None, help="EXO_BATCH_SIZE (default: the largest N)")
  p.add_argument("--batch-timeout-ms", type=float, default=5.0)
  p.add_argument("--prefill-chunk", type=int, default=None)
  p.add_argument("--baseline", default=None, help="another checkout of exo whose ring runs in each pair too (its ring ÷ the same single node)")
  p.add_argument("--baseline-placement", default=None, help="EXO_PLACEMENT of the baseline's ring (default: its nodes' own)")
  p.add_argument("--out", default=str(ROOT / "bench" / "results"))
  p.add_argument("--no-ceiling", dest="ceiling", action="store_false", help="skip timing the ceiling")
  p.add_argument("--step-times", default=None, help=argparse.SUPPRESS)  # the ceiling's child: the rows per step to time
  p.add_argument("--context", type=int, default=96, help=argparse.SUPPRESS)
  p.add_argument("--wait-for-go", action="store_true", help=argparse.SUPPRESS)  # the ceiling's child: start the steps on a line from stdin
  args = p.parse_args()
  if args.step_times:
    print(json.dumps(await step_times([int(n) for n in args.step_times.split(",")], args.engine, args.context, wait_for_go=args.wait_for_go)))
    return
  ns = [int(n) for n in args.ns.split(",") if n]
  args.capacity_ns = [int(n) for n in args.capacity_ns.split(",") if n]
  placements = [x for x in args.placements.split(",") if x]
  clients = ["spread", "one"] if args.clients == "both" else [args.clients]
  args.batch_size = args.batch_size or max(ns + args.capacity_ns + [2, args.conversations])
  if args.nodes * args.cores_per_node > len(os.sched_getaffinity(0)):
    raise SystemExit(f"{args.nodes} nodes x {args.cores_per_node} cores need more than this machine's {len(os.sched_getaffinity(0))} cores")
  args.log_dir = tempfile.mkdtemp(prefix="exo-machines-")
  Path(args.out).mkdir(parents=True, exist_ok=True)
  path = Path(args.out) / f"machines-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
  print(f"exo machines bench: {args.nodes} nodes x {args.cores_per_node} core(s), {args.hop_delay_ms:g} ms each way, placements {placements}, "
        f"clients {clients}, N={ns}, {args.pairs} pair(s), {args.prompt_tokens} prompt + {args.tokens} generated tokens; logs in {args.log_dir}", flush=True)
  runs, caps = [], []
  with open(path, "w") as out:
    reference = await unbatched_reference(args, ns)
    out.write(json.dumps({"unbatched": reference}) + "\n")
    for pair in range(args.pairs):
      if args.ceiling:  # once per pair, so that its median spans the same drift as the clusters'
        caps.append(ceiling(args, ns))
        out.write(json.dumps({"pair": pair, "ceiling": caps[-1]}) + "\n")
      order = [(pl, cl, ROOT) for pl in placements for cl in clients] + ([(args.baseline_placement, "one", Path(args.baseline))] if args.baseline else [])
      if pair % 2:
        order.reverse()
      runs.append({run_label(pl, cl, root): await run_pair(args, pl, cl, ns, pair, out, root) for pl, cl, root in order})
  report(args, ns, runs, caps, reference)
  print(f"\nraw figures: {path}")


if __name__ == "__main__":
  asyncio.run(main())

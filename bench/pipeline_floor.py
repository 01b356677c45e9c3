"""What a pipeline's one stream could reach with no cost of its own: one node's whole decode step against the sum of
the stages' steps plus the links a token crosses, each stage timed on its own engine in this process, pinned to one
core (as bench/machines.py pins a node).

  python bench/pipeline_floor.py                          # a 2-stage cut (bench/machines.py's table names the one its pipeline chose)
  python bench/pipeline_floor.py --stages 0-9,10-19,20-29 --hop-delay-ms 1

A token of a p-stage ring crosses p links (each stage's output to the next, the last stage's token back to the first).
With zero cost for messages, scheduling and sampling outside the engine, one stream's time between tokens is
sum(stage steps) + p x delay, and its speed against one node is the whole step over that: the most the pipeline's
one-stream figure (bench/machines.py --placements pipeline --ns 1) can show on this machine. The stage steps sum to
more than the whole step: each pays its own fixed cost. The steps alternate in order each round, so that drift
favours none."""
import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import MODEL  # noqa: E402


async def step_seconds(stages, engine: str, context: int, rounds: int):
  """(whole step, [each stage's step]) medians, one row decoding after a prompt of `context` tokens."""
  from exo.download.shard_download import HFShardDownloader
  from exo.inference.engines import get_inference_engine
  from exo.inference.shard import Shard
  from exo.models import build_base_shard

  engines = [get_inference_engine(engine, HFShardDownloader()) for _ in range(len(stages) + 1)]  # (an engine holds one shard)
  n_layers = build_base_shard(MODEL, type(engines[0]).__name__).n_layers
  if stages[-1][1] != n_layers - 1:
    raise SystemExit(f"the last stage must end at layer {n_layers - 1}")
  shards = [Shard(MODEL, 0, n_layers - 1, n_layers)] + [Shard(MODEL, start, end, n_layers) for start, end in stages]
  prompt = np.random.default_rng(0).integers(100, 1000, (1, context))

  async def chain(x, split: bool):
    """Each step's seconds, stage by stage from layer 0 (or the whole model alone), each output the next one's input."""
    times = []
    for shard, engine in (list(zip(shards[1:], engines[1:])) if split else [(shards[0], engines[0])]):
      start = time.perf_counter()
      [(out, _)] = await engine.infer_batch(shard, [("stream", x, None)])
      times.append(time.perf_counter() - start)
      x = out
    return times

  await chain(prompt, False)
  await chain(prompt, True)
  whole, split = [], []
  for r in range(rounds + 2):
    token = np.array([[100 + r]])
    for staged in ((False, True) if r % 2 else (True, False)):
      times = await chain(token, staged)
      if r >= 2:  # the first two: allocations, caches warming
        (split if staged else whole).append(times)
  return statistics.median(t[0] for t in whole), [statistics.median(t[k] for t in split) for k in range(len(stages))]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--engine", default="numpy")
  p.add_argument("--stages", default="0-17,18-29", help="each stage's layers, first to last")
  p.add_argument("--hop-delay-ms", type=float, default=1.0, help="one-way delay of each link (bench/machines.py's relay)")
  p.add_argument("--core", type=int, default=0)
  p.add_argument("--context", type=int, default=96)
  p.add_argument("--rounds", type=int, default=24)
  args = p.parse_args()
  stages = [tuple(int(x) for x in stage.split("-")) for stage in args.stages.split(",")]
  if stages[0][0] != 0 or any(a[1] + 1 != b[0] for a, b in zip(stages, stages[1:])):
    raise SystemExit("--stages must cover the layers from 0 in order, e.g. 0-17,18-29")
  os.sched_setaffinity(0, {args.core})
  whole, steps = asyncio.run(step_seconds(stages, args.engine, args.context, args.rounds))
  links = len(stages) * args.hop_delay_ms / 1e3
  floor = sum(steps) + links
  print(f"whole step {1e3 * whole:.2f} ms; stages " + " + ".join(f"{1e3 * t:.2f}" for t in steps) + f" = {1e3 * sum(steps):.2f} ms; "
        f"{len(stages)} links x {args.hop_delay_ms:g} ms: one stream's time between tokens at the least {1e3 * floor:.2f} ms, "
        f"{whole / floor:.3f}x one node's bare step")


if __name__ == "__main__":
  main()

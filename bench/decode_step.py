"""The numpy engine's decode step taken whole in one compiled call (fused_decode.FusedDecode.step: embedding, layers,
final norm and head) against its layers alone in that call with the ends in numpy (the step before the head was
compiled), both through the engine (infer_batch) on the embedded SmolLM2, in one process: the model swaps between
the two passes step by step, so that a shared machine's load falls on both alike.

  python bench/decode_step.py                      # 1 and 4 streams, each way of sharing
  python bench/decode_step.py --streams 1 --steps 64

Per stream count and way: `auto` as a node runs (each pass with its own packed.SharedDecode timing the shared and
one-core ways and taking the faster), `shared` (OpenMP's threads) and `one core` forced. Prints median ms a step,
the ratio, and the ratio of the CPU time the two spent (bench/quantized_speed.py's cpu_ratio)."""
import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from quantized_speed import cpu_ratio  # noqa: E402

from exo.download.shard_download import HFShardDownloader  # noqa: E402
from exo.inference.engines import get_inference_engine  # noqa: E402
from exo.inference.numpy import kernels  # noqa: E402
from exo.inference.numpy.fused_decode import FusedDecode  # noqa: E402
from exo.inference.numpy.packed import SharedDecode  # noqa: E402
from exo.inference.shard import Shard  # noqa: E402
from exo.local_checkpoints import serve  # noqa: E402
from exo.models import model_cards  # noqa: E402

WARMUP = 4
WAYS = {"auto": None, "shared": True, "one core": False}


async def main(args) -> None:
  engine = get_inference_engine("numpy", HFShardDownloader())
  model_id = serve([args.model])[0]
  n_layers = model_cards[model_id]["layers"]
  shard = Shard(model_id, 0, n_layers - 1, n_layers)
  await engine.ensure_shard(shard)
  model = engine.model
  passes = {"layers + numpy ends": FusedDecode(model, whole_steps=False), "whole step": FusedDecode(model)}
  assert passes["whole step"].whole, "this model's ends are not compiled: no whole step to measure"
  on_engine = lambda fn, *a: engine.executor.submit(fn, *a).result()  # the step's sharing is the engine thread's own
  rng = np.random.default_rng(0)
  for streams in args.streams:
    for way, shared in WAYS.items():
      deciders = {name: SharedDecode() if shared is None else None for name in passes}
      ids = {name: [f"{name}-{streams}-{way}-{i}" for i in range(streams)] for name in passes}
      prompts = [rng.integers(100, 10000, args.context).reshape(1, -1) for _ in range(streams)]
      tokens = {}
      for name in passes:
        results = await engine.infer_batch(shard, [(r, x, None) for r, x in zip(ids[name], prompts)])
        tokens[name] = [np.argmax(logits.reshape(-1)).reshape(1, 1) for logits, _ in results]
      wall, cpu = {name: [] for name in passes}, {name: [] for name in passes}
      on_engine(kernels.set_step_shared, bool(shared))
      try:
        for step in range(WARMUP + args.steps):
          for name, fused in passes.items():
            model.fused_decode, model.shared_decode = fused, deciders[name]
            items = [(r, t, None) for r, t in zip(ids[name], tokens[name])]
            took, spent = [], []
            results = await timed_step(engine, shard, items, took, spent)
            if step >= WARMUP:
              wall[name] += took
              cpu[name] += spent
            tokens[name] = [np.argmax(logits.reshape(-1)).reshape(1, 1) for logits, _ in results]
      finally:
        on_engine(kernels.set_step_shared, False)
      for name in passes:
        for r in ids[name]:
          await engine.finish_request(r)
      before, after = (1000 * statistics.median(wall[name]) for name in passes)
      print(f"{streams} streams, {way:>8}: layers + numpy ends {before:.2f} ms, whole step {after:.2f} ms, speed ratio "
            f"{before / after:.2f}x ({1000 * streams / before:.1f} vs {1000 * streams / after:.1f} tokens/s), "
            f"{cpu_ratio(cpu, *passes)}", flush=True)
  model.fused_decode, model.shared_decode = passes["whole step"], SharedDecode()


async def timed_step(engine, shard, items, took: list, spent: list):
  """engine.infer_batch(shard, items), its wall and CPU time appended (as quantized_speed.timed)."""
  started, started_cpu = time.perf_counter(), time.process_time()
  results = await engine.infer_batch(shard, items)
  took.append(time.perf_counter() - started)
  spent.append(time.process_time() - started_cpu)
  return results


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2-135m", help="a model id or a local checkpoint's path")
  parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
  parser.add_argument("--steps", type=int, default=48, help="timed steps of each pass per stream count and way")
  parser.add_argument("--context", type=int, default=24, help="tokens each stream's prompt holds before the timed steps")
  asyncio.run(main(parser.parse_args()))

"""The numpy engine's decode step as it is against as it was, through the engine (infer_batch) on the embedded
SmolLM2, in one process: the model swaps between the two step by step, so that a shared machine's load falls on both
alike.

  python bench/decode_step.py                      # 1 and 4 streams, each way of sharing
  python bench/decode_step.py --streams 1 --steps 64
  python bench/decode_step.py --same-kernels       # only the whole step against the layers alone, same kernels

`whole step`: the step in one compiled call (fused_decode.FusedDecode.step: embedding, layers, final norm and head).
`before`: the layers alone in that call, the embedding, final norm and head in numpy around it (the head's product
still compiled), and the kernels built to read float16 scales through their table (EXO_HALVES_BY_TABLE: the way they
were read before the CPU converted them; with --same-kernels, the kernels the engine loaded; with --before-library,
that build, e.g. of an earlier revision's kernels_c).

Per stream count and way: `auto` as a node runs (each pass with its own packed.SharedDecode timing the shared and
one-core ways and taking the faster), `shared` (OpenMP's threads) and `one core` forced. Prints median ms a step,
the speed ratio, and the ratio of the CPU time the two spent (bench/quantized_speed.py's cpu_ratio)."""
import argparse
import asyncio
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from quantized_speed import cpu_ratio  # noqa: E402

from exo.download.shard_download import HFShardDownloader  # noqa: E402
from exo.inference.engines import get_inference_engine  # noqa: E402
from exo.inference.numpy import fused_decode, kernels, native, packed  # noqa: E402
from exo.inference.numpy.fused_decode import FusedDecode  # noqa: E402
from exo.inference.numpy.packed import SharedDecode  # noqa: E402
from exo.inference.shard import Shard  # noqa: E402
from exo.local_checkpoints import serve  # noqa: E402
from exo.models import model_cards  # noqa: E402

WARMUP = 4
WAYS = {"auto": None, "shared": True, "one core": False}


def table_kernels() -> ctypes.CDLL:
  """The kernels built as the engine builds them, but reading float16 scales through their table."""
  path = Path(tempfile.mkdtemp(prefix="exo-bench-")) / "kernels-by-table.so"
  flags = native.FLAGS
  native.FLAGS = flags + ["-DEXO_HALVES_BY_TABLE"]
  try:
    native._build(native.compiler(), path)
  finally:
    native.FLAGS = flags
  return native.prepared(ctypes.CDLL(str(path)), native.array_fields_offset())


def use_kernels(lib: ctypes.CDLL) -> None:
  fused_decode._lib = packed._lib = lib


async def main(args) -> None:
  engine = get_inference_engine("numpy", HFShardDownloader())
  model_id = serve([args.model])[0]
  n_layers = model_cards[model_id]["layers"]
  shard = Shard(model_id, 0, n_layers - 1, n_layers)
  await engine.ensure_shard(shard)
  model = engine.model
  loaded = native.library()
  before_kernels = loaded if args.same_kernels else table_kernels() if args.before_library is None else \
      native.prepared(ctypes.CDLL(args.before_library), native.array_fields_offset())
  passes = {"before": (FusedDecode(model, whole_steps=False), before_kernels),
            "whole step": (FusedDecode(model), loaded)}
  assert passes["whole step"][0].whole, "this model's ends are not compiled: no whole step to measure"
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
          for name, (fused, lib) in passes.items():
            model.fused_decode, model.shared_decode = fused, deciders[name]
            use_kernels(lib)
            items = [(r, t, None) for r, t in zip(ids[name], tokens[name])]
            started, started_cpu = time.perf_counter(), time.process_time()
            results = await engine.infer_batch(shard, items)
            if step >= WARMUP:
              wall[name].append(time.perf_counter() - started)
              cpu[name].append(time.process_time() - started_cpu)
            tokens[name] = [np.argmax(logits.reshape(-1)).reshape(1, 1) for logits, _ in results]
      finally:
        on_engine(kernels.set_step_shared, False)
        use_kernels(loaded)
      for name in passes:
        for r in ids[name]:
          await engine.finish_request(r)
      before, after = (1000 * statistics.median(wall[name]) for name in passes)
      print(f"{streams} streams, {way:>8}: before {before:.2f} ms, whole step {after:.2f} ms, speed ratio "
            f"{before / after:.2f}x ({1000 * streams / before:.1f} vs {1000 * streams / after:.1f} tokens/s), "
            f"{cpu_ratio(cpu, *passes)}", flush=True)
  model.fused_decode, model.shared_decode = passes["whole step"][0], SharedDecode()


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", default="smollm2-135m", help="a model id or a local checkpoint's path")
  parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
  parser.add_argument("--steps", type=int, default=48, help="timed steps of each pass per stream count and way")
  parser.add_argument("--context", type=int, default=24, help="tokens each stream's prompt holds before the timed steps")
  parser.add_argument("--same-kernels", action="store_true", help="both passes on the engine's kernels")
  parser.add_argument("--before-library", help="the before pass on this build of the kernels (any with decode_step), "
                      "in place of the engine's built with EXO_HALVES_BY_TABLE")
  asyncio.run(main(parser.parse_args()))

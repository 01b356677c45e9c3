"""Where a decode step's time goes, on the numpy engine with the embedded SmolLM2 (or --model): each phase's wall
time, every layer's phases summed, at each row count.

  python bench/decode_profile.py --rows 8,16,32

Phases are the engine's own column-shared calls, timed where the step hands them out (llama.split_columns and
split_over_cores, which return when every core's slice is done): qkv (the q/k/v product with RoPE and the cache
write), attend, o_proj, gate_up (with SiLU), down and head. `other` is the rest of the step: the norms, the embedding
lookup and Python between the calls. A step small enough for fused_decode.py runs as one call, timed as `fused`."""
import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exo.download.shard_files import embedded_model_path  # noqa: E402
from exo.inference.numpy import llama  # noqa: E402
from exo.inference.numpy.engine import GIL_SWITCH_S  # noqa: E402
from exo.inference.numpy.kernels import single_threaded_blas  # noqa: E402
from exo.inference.shard import Shard  # noqa: E402
from exo.inference.weights import load_config, load_shard_weights  # noqa: E402

spent = defaultdict(float)


def timed_phase(original):
  def run(part, n, *args, **kwargs):
    started = time.perf_counter()
    try:
      return original(part, n, *args, **kwargs)
    finally:
      spent[part.__name__] += time.perf_counter() - started
  return run


def main(args) -> None:
  single_threaded_blas()
  sys.setswitchinterval(GIL_SWITCH_S)  # as the engine runs its steps
  path = args.model or str(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
  n_layers = load_config(path).n_layers
  shard = Shard(path, 0, n_layers - 1, n_layers)
  config, weights = load_shard_weights(path, shard, keep_quantized=True)
  model = llama.Llama(config, shard, weights)
  llama.split_columns = timed_phase(llama.split_columns)
  llama.split_over_cores = timed_phase(llama.split_over_cores)
  rng = np.random.default_rng(0)
  for rows in args.rows:
    caches = [model.new_cache() for _ in range(rows)]
    model.forward([rng.integers(100, 10000, args.context) for _ in range(rows)], caches)
    totals, phases = [], defaultdict(list)
    for step in range(args.steps + 2):
      spent.clear()
      tokens = [rng.integers(100, 10000, 1) for _ in range(rows)]
      started = time.perf_counter()
      model.forward(tokens, caches)
      took = time.perf_counter() - started
      if step < 2:
        continue
      totals.append(took)
      for name, seconds in spent.items():
        phases[name].append(seconds)
      phases["other"].append(took - sum(spent.values()))
    total = statistics.median(totals)
    parts = ", ".join(f"{name} {1000 * statistics.median(v):.1f}" for name, v in phases.items())
    print(f"{rows:>3} rows: step {1000 * total:.1f} ms ({rows / total:.0f} tokens/s): {parts}", flush=True)
    del caches


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", help="a quantized checkpoint's path (default: the embedded SmolLM2)")
  parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32])
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--context", type=int, default=24, help="tokens each stream's cache holds before the timed steps")
  main(parser.parse_args())

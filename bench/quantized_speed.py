"""The numpy engine on a quantized checkpoint, kept quantized against the same checkpoint dequantised to float32: both
models in one process, their steps alternated, so that a shared machine's load falls on both alike.

  python bench/quantized_speed.py                      # the embedded SmolLM2 (GGUF Q4_1), 1, 16 and 64 streams
  python bench/quantized_speed.py --model PATH --streams 1,8 --steps 16
  python bench/quantized_speed.py --kv --context 1000   # float16 KV cache against float32, weights kept quantized

Per stream count: a decode step for every stream at once (each stream's cache holding its prompt), median ms of
--steps alternated steps each; then a prefill of --prompt tokens; and the bytes each model's weights hold. Each
speed ratio comes with the ratio of the CPU time the two spent (see cpu_ratio)."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exo.download.shard_files import embedded_model_path  # noqa: E402
from exo.inference.numpy.kernels import single_threaded_blas  # noqa: E402
from exo.inference.numpy.llama import Llama  # noqa: E402
from exo.inference.shard import Shard  # noqa: E402
from exo.inference.weights import load_config, load_shard_weights  # noqa: E402


def weight_bytes(model: Llama) -> int:
  arrays = [w for layer in model.layers for w in layer.values()] + [model.head, model.embed, model.norm]
  return sum(w.nbytes for w in arrays if w is not None)


def main(args) -> None:
  single_threaded_blas()
  path = args.model or str(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
  n_layers = load_config(path).n_layers
  shard = Shard(path, 0, n_layers - 1, n_layers)
  models = {}
  if args.kv:  # the same weights, two cache widths: the first model is the one compared
    config, weights = load_shard_weights(path, shard, keep_quantized=True)
    models = {"kv float16": Llama(config, shard, weights, kv_dtype=np.float16), "kv float32": Llama(config, shard, weights, kv_dtype=np.float32)}
  for name, keep in (() if args.kv else (("quantized", True), ("float32", False))):
    config, weights = load_shard_weights(path, shard, keep_quantized=keep)
    models[name] = Llama(config, shard, weights)
    del weights
  first, second = models
  for name, model in models.items():
    print(f"{name}: weights {weight_bytes(model) / 2**20:.1f} MiB")
  rng = np.random.default_rng(0)
  for streams in args.streams:
    caches = {name: [m.new_cache() for _ in range(streams)] for name, m in models.items()}
    prompts = [rng.integers(100, 10000, args.context) for _ in range(streams)]
    for name, m in models.items():
      m.forward(prompts, caches[name])
    times, cpu = {name: [] for name in models}, {name: [] for name in models}
    for _ in range(args.steps):
      tokens = [rng.integers(100, 10000, 1) for _ in range(streams)]
      for name, m in models.items():
        timed(lambda: m.forward(tokens, caches[name]), times[name], cpu[name])
    q, f = (1000 * statistics.median(times[n]) for n in (first, second))
    print(f"{streams:>3} streams, decode step: {first} {q:.1f} ms, {second} {f:.1f} ms, speed ratio {f / q:.2f}x "
          f"({1000 * streams / q:.1f} vs {1000 * streams / f:.1f} tokens/s), {cpu_ratio(cpu, first, second)}", flush=True)
    del caches  # their slots go back to the pool
  times, cpu = {name: [] for name in models}, {name: [] for name in models}
  for _ in range(max(3, args.steps // 4)):
    prompt = rng.integers(100, 10000, args.prompt)
    for name, m in models.items():
      cache = m.new_cache()
      timed(lambda: m.forward([prompt], [cache]), times[name], cpu[name])
      del cache
  q, f = (1000 * statistics.median(times[n]) for n in (first, second))
  print(f"prefill of {args.prompt} tokens: {first} {q:.0f} ms, {second} {f:.0f} ms, speed ratio {f / q:.2f}x, "
        f"{cpu_ratio(cpu, first, second)}")


def timed(run, wall: list, cpu: list) -> None:
  """Appends run()'s wall time and the CPU time this process spent in it (all its threads)."""
  started, started_cpu = time.perf_counter(), time.process_time()
  run()
  wall.append(time.perf_counter() - started)
  cpu.append(time.process_time() - started_cpu)


def cpu_ratio(cpu: dict, first: str, second: str) -> str:
  """The second model's median CPU time a step over the first's: the work each does, which other processes on a
  shared machine disturb less than the wall time (a step that waits for a core spends no CPU time meanwhile)."""
  return f"CPU time ratio {statistics.median(cpu[second]) / statistics.median(cpu[first]):.2f}x"


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", help="a quantized checkpoint's path (default: the embedded SmolLM2)")
  parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
  parser.add_argument("--steps", type=int, default=24, help="timed steps of each model per stream count")
  parser.add_argument("--prompt", type=int, default=512, help="tokens of the timed prefill")
  parser.add_argument("--context", type=int, default=24, help="tokens each stream's cache holds before the timed decode steps")
  parser.add_argument("--kv", action="store_true", help="compare KV caches of float16 and float32 (weights kept quantized in both)")
  main(parser.parse_args())

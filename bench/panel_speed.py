"""A batched decode step of the numpy engine with the panel kernel (kernels_c/panels.c) against the same step with
quantized tiles widened for BLAS, in one process, steps alternated, so that a shared machine's load falls on both.

  python bench/panel_speed.py --rows 8,16,32 --steps 20
  python bench/panel_speed.py --products   # each of SmolLM2's products alone on one core, every layer's in turn
  python bench/panel_speed.py --fused      # the fused step (one C call, OpenMP's threads) against llama.py's layers

Whole steps: the embedded SmolLM2 (GGUF Q4_1 layers, Q8_0 head), each stream's cache holding --context tokens; the
median ms of each way's steps and the ratio, and the same of the CPU time the process spent (all its threads), which
other processes on a shared machine disturb less. --products: one core, each matrix of every layer in turn (so that they
come from memory as in a step), for the direct kernel (up to 16 rows), the panels and the tiles. --fused: whole steps
through fused_decode.py's one call, shared among OpenMP's threads (decoder.c's phases), against llama.py's layers with
their products' columns shared among the engine's threads, both with the panels."""
import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exo.download.shard_files import embedded_model_path  # noqa: E402
from exo.inference.numpy import kernels, llama, packed  # noqa: E402
from exo.inference.numpy.engine import GIL_SWITCH_S  # noqa: E402
from exo.inference.numpy.kernels import single_threaded_blas  # noqa: E402
from exo.inference.shard import Shard  # noqa: E402
from exo.inference.weights import load_config, load_shard_weights  # noqa: E402

WAYS = {"panels": packed.PANEL_ROWS, "tiles": 0}  # packed.PANEL_ROWS for each way


def load(path: str) -> llama.Llama:
  n_layers = load_config(path).n_layers
  shard = Shard(path, 0, n_layers - 1, n_layers)
  config, weights = load_shard_weights(path, shard, keep_quantized=True)
  return llama.Llama(config, shard, weights)


def alternate(model: llama.Llama, rows: int, args, ways: dict) -> tuple:
  """Each way's median wall and CPU seconds a step at `rows` streams, the ways taking turns step by step (`ways`: name
  -> what sets it up before its step); the first step of each way warms and is not counted."""
  rng = np.random.default_rng(0)
  caches = [model.new_cache() for _ in range(rows)]
  model.forward([rng.integers(100, 10000, args.context) for _ in range(rows)], caches)
  times, cpu = {way: [] for way in ways}, {way: [] for way in ways}
  for step in range(args.steps + 1):
    for way, set_up in ways.items():
      set_up()
      tokens = [rng.integers(100, 10000, 1) for _ in range(rows)]
      started, started_cpu = time.perf_counter(), time.process_time()
      model.forward(tokens, caches)
      if step:
        times[way].append(time.perf_counter() - started)
        cpu[way].append(time.process_time() - started_cpu)
  return ({way: statistics.median(t) for way, t in times.items()}, {way: statistics.median(t) for way, t in cpu.items()})


def steps(model: llama.Llama, args) -> None:
  own, model.fused_decode = model.fused_decode, None  # llama.py's layers: the fused pass takes the panels either way
  ways = {way: (lambda panel_rows=panel_rows: setattr(packed, "PANEL_ROWS", panel_rows)) for way, panel_rows in WAYS.items()}
  for rows in args.rows:
    times, cpu = alternate(model, rows, args, ways)
    p, t = (1000 * times[way] for way in WAYS)
    p_cpu, t_cpu = (1000 * cpu[way] for way in WAYS)
    print(f"{rows:>3} rows: panels {p:.1f} ms, tiles {t:.1f} ms a step: {t / p:.2f}x ({rows * 1000 / p:.0f} against "
          f"{rows * 1000 / t:.0f} tokens/s); CPU time a step {p_cpu:.1f} against {t_cpu:.1f} ms, {t_cpu / p_cpu:.2f}x", flush=True)
  packed.PANEL_ROWS, model.fused_decode = WAYS["panels"], own


def fused(model: llama.Llama, args) -> None:
  """Ways alternated step by step: "fused" (shared), "fused, one core" (the same call on the calling thread),
  "layers" (llama.py, its columns shared among the engine's threads)."""
  own, model.shared_decode = model.fused_decode, None  # each way forced, not timed and chosen
  one_core = type(own)(model)
  one_core.takes_rows = lambda rows: True  # (unshared, a multi-row step is otherwise llama.py's)

  def way(pass_, shared):
    def set_up():
      model.fused_decode = pass_
      kernels.set_step_shared(shared)
    return set_up
  ways = {"fused": way(own, True), "fused, one core": way(one_core, False), "layers": way(None, False)}
  for rows in args.rows:
    times, cpu = alternate(model, rows, args, ways)
    kernels.set_step_shared(False)
    print(f"{rows:>3} rows, ms a step (CPU ms), speed against the layers: " + ", ".join(
      f"{way} {1000 * times[way]:.1f} ({1000 * cpu[way]:.1f}) {times['layers'] / times[way]:.2f}x" for way in ways), flush=True)
  model.fused_decode = own


def products(model: llama.Llama, args) -> None:
  matrices = {name: [layer[name] for layer in model.layers] for name in ("qkv", "o", "gate_up", "down")}
  matrices["head"] = [model.head]
  rng = np.random.default_rng(0)
  for rows in args.rows:
    ways = {"panels": lambda w, x, out: w.panels(x, 0, w.shape[0], out)}
    ways["tiles"] = lambda w, x, out: w.product(x, 0, w.shape[0], out)  # (PANEL_ROWS 0: the tiles)
    if rows <= 16:
      ways["direct"] = lambda w, x, out: w.direct(x, 0, w.shape[0], out, shared=False)
    totals = {way: 0.0 for way in ways}
    for name, ws in matrices.items():
      x = rng.standard_normal((rows, ws[0].shape[1])).astype(np.float32)
      out = np.empty((rows, ws[0].shape[0]), dtype=np.float32)
      best = {way: float("inf") for way in ways}
      for _ in range(args.repeats):
        for way, run in ways.items():
          packed.PANEL_ROWS, saved_direct = 0, packed.DIRECT_ROWS
          packed.DIRECT_ROWS = 0
          started = time.perf_counter()
          for w in ws:
            run(w, x, out)
          best[way] = min(best[way], time.perf_counter() - started)
          packed.DIRECT_ROWS = saved_direct
      for way in ways:
        totals[way] += best[way]
      print(f"  {rows:>3} rows {name}: " + ", ".join(f"{way} {1000 * s:.1f} ms" for way, s in best.items()))
    print(f"{rows:>3} rows, every product once: " + ", ".join(f"{way} {1000 * s:.1f} ms ({s / totals['tiles']:.2f}x tiles)"
                                                            for way, s in totals.items()), flush=True)
  packed.PANEL_ROWS = WAYS["panels"]


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", help="a quantized checkpoint's path (default: the embedded SmolLM2)")
  parser.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32])
  parser.add_argument("--steps", type=int, default=20, help="timed steps of each way per row count")
  parser.add_argument("--repeats", type=int, default=3, help="--products: runs of each way, the best counted")
  parser.add_argument("--context", type=int, default=24, help="tokens each stream's cache holds before the timed steps")
  parser.add_argument("--products", action="store_true", help="each product alone on one core, not whole steps")
  parser.add_argument("--fused", action="store_true", help="the fused step against llama.py's layers")
  args = parser.parse_args()
  single_threaded_blas()
  sys.setswitchinterval(GIL_SWITCH_S)  # as the engine runs its steps
  model = load(args.model or str(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")))
  (products if args.products else fused if args.fused else steps)(model, args)

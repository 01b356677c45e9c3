"""Which form of a weight product is fastest for how many rows, on this machine, for SmolLM2-135M's shapes.

  python bench/products.py                      # rows 1..256, every form, all cores
  python bench/products.py --rows 1,16,64 --threads 1

Forms: `sgemm`, x (rows, in) @ w (in, out) as the engine keeps its weights; `w.T`, the same with the weight kept
(out, in) as checkpoints store it; `blocked`, the weight in 32-column blocks (out / 32, in, 32), one small product
per block, the layout this engine used before. With several cores each form's columns are shared among them as the
engine does (kernels.split_over_cores). Each product reads one of several copies of its weight in turn (64 MB or
more in all), so that the weight comes from memory as in a real step, not from cache.

`sgemm_peak()` is the machine's float32 sgemm rate, a large square product on all cores: the benchmark prints the
model's achieved FLOP/s as a fraction of it. `--ceiling N` prints the most that fraction can be at N streams for any
engine whose products run no faster than these (see `ceiling`)."""
import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(1, str(Path(__file__).resolve().parent))

from exo.inference.numpy import kernels  # noqa: E402
from exo.inference.numpy.kernels import single_threaded_blas  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "head": (576, 49152)}
LAYERS = 30  # each shape but the head once per layer
PROMPT_ROWS = 256  # rows a prompt step is counted at in the ceiling (more than any bench step of prompts holds)
BLOCK = 32
COLD_BYTES = 64 << 20


def best_seconds(fn: Callable[[], None], least: float = 0.3, runs: int = 3) -> float:
  fn()
  best, spent, n = float("inf"), 0.0, 0
  while spent < least or n < runs:
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    best, spent, n = min(best, took), spent + took, n + 1
  return best


def sgemm_peak(n: int = 2048) -> float:
  """GFLOP/s of an n x n x n float32 product, its columns shared among the cores; the best of several."""
  single_threaded_blas()
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
  return 2 * n ** 3 / best_seconds(lambda: kernels.matmul(a, b), least=1.0) / 1e9


def blocked_product(x: np.ndarray, blocks: np.ndarray, split: bool) -> np.ndarray:
  rows, n_blocks = x.shape[0], blocks.shape[0]
  out = np.empty((rows, n_blocks * BLOCK), dtype=np.float32)

  def part(lo: int, hi: int) -> None:
    out.reshape(rows, n_blocks, BLOCK)[:, lo:hi] = np.matmul(x, blocks[lo:hi]).transpose(1, 0, 2)
  kernels.split_over_cores(part, n_blocks) if split else part(0, n_blocks)
  return out


def measure(n_in: int, n_out: int, rows_list: List[int], split: bool) -> Dict[str, List[float]]:
  rng = np.random.default_rng(1)
  copies = max(1, -(-COLD_BYTES // (n_in * n_out * 4)))
  weights = [rng.standard_normal((n_in, n_out), dtype=np.float32) for _ in range(copies)]
  forms = {
    "sgemm": [w for w in weights],
    "w.T": [np.ascontiguousarray(w.T) for w in weights],
    "blocked": [np.ascontiguousarray(w.reshape(n_in, -1, BLOCK).transpose(1, 0, 2)) for w in weights],
  }
  run = {
    "sgemm": lambda x, w: kernels.matmul(x, w) if split else x @ w,
    "w.T": lambda x, w: kernels.matmul(x, w.T) if split else x @ w.T,
    "blocked": lambda x, w: blocked_product(x, w, split),
  }
  result: Dict[str, List[float]] = {name: [] for name in forms}
  for rows in rows_list:
    x = rng.standard_normal((rows, n_in), dtype=np.float32)
    for name, ws in forms.items():
      def cycle(ws=ws, fn=run[name]):
        for w in ws:
          fn(x, w)
      result[name].append(2 * rows * n_in * n_out * copies / best_seconds(cycle) / 1e9)
  return result


def ceiling(n: int, prompt_tokens: int, tokens: int, split: bool) -> Dict[str, float]:
  """bench.py's "of peak" figure at n streams of prompt_tokens + tokens if every weight product ran at the fastest
  form's rate measured here for its rows, and nothing else took any time (attention, norms, sampling, the event
  loop): an upper bound for an engine built on these products. Generated tokens run as `tokens` steps of n rows; the
  prompts' rows as steps of PROMPT_ROWS (the faster end of this table), each request's last row through the head.
  The FLOPs counted are the bench's: the generated tokens' forward passes, attention included at their mean context."""
  rows = sorted({n, PROMPT_ROWS})
  rate = {}  # (shape, rows) -> GFLOP/s of the fastest form
  for name, (n_in, n_out) in SHAPES.items():
    result = measure(n_in, n_out, rows, split)
    for i, r in enumerate(rows):
      rate[name, r] = max(rates[i] for rates in result.values())

  def seconds(name: str, r: int, count: int) -> float:
    n_in, n_out = SHAPES[name]
    return count * 2 * r * n_in * n_out / (rate[name, r] * 1e9)
  layers = [name for name in SHAPES if name != "head"]
  decode_step = sum(seconds(name, n, LAYERS) for name in layers) + seconds("head", n, 1)
  prompts = sum(seconds(name, PROMPT_ROWS, LAYERS) for name in layers) * n * prompt_tokens / PROMPT_ROWS + seconds("head", n, 1)
  from bench import model_flops_per_token  # bench/bench.py, beside this file
  peak = sgemm_peak()
  achieved = n * tokens * model_flops_per_token(prompt_tokens, tokens) / (prompts + tokens * decode_step) / 1e9
  return {"peak": peak, "achieved": achieved, "fraction": achieved / peak, "decode_step_s": decode_step, "prompts_s": prompts}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
  p.add_argument("--threads", type=int, default=kernels.CORES, choices=[1, kernels.CORES])
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--peak", action="store_true", help="print only the sgemm peak, GFLOP/s")
  p.add_argument("--ceiling", type=int, metavar="N", help="print the bench's highest possible 'of peak' figure at N streams")
  p.add_argument("--prompt-tokens", type=int, default=64, help="with --ceiling: as bench.py's")
  p.add_argument("--tokens", type=int, default=128, help="with --ceiling: as bench.py's")
  args = p.parse_args()
  if args.peak:
    print(f"{sgemm_peak():.1f}")
    return
  if args.ceiling:
    single_threaded_blas()
    c = ceiling(args.ceiling, args.prompt_tokens, args.tokens, args.threads > 1)
    print(f"N={args.ceiling}, {args.prompt_tokens} prompt + {args.tokens} generated tokens, products at this table's fastest rates and "
          f"nothing else: decode steps {c['decode_step_s'] * 1e3:.0f} ms, prompts {c['prompts_s']:.2f} s; {c['achieved']:.0f} GFLOP/s, "
          f"at most {c['fraction']:.0%} of the sgemm peak ({c['peak']:.0f} GFLOP/s)")
    return
  single_threaded_blas()
  rows_list = [int(r) for r in args.rows.split(",")]
  split = args.threads > 1
  print(f"GFLOP/s per form, weights from memory, {args.threads} core(s); sgemm peak {sgemm_peak():.0f} GFLOP/s on {kernels.CORES} core(s)")
  print(f"{'shape':>16} {'form':>8} " + " ".join(f"{r:>6}" for r in rows_list))
  for name in args.shapes.split(","):
    n_in, n_out = SHAPES[name]
    result = measure(n_in, n_out, rows_list, split)
    for form, rates in result.items():
      print(f"{name + f' {n_in}x{n_out}':>16} {form:>8} " + " ".join(f"{r:6.1f}" for r in rates))
    fastest = [max(result, key=lambda form: result[form][i]) for i in range(len(rows_list))]
    print(f"{'':>16} {'fastest':>8} " + " ".join(f"{f:>6}" for f in fastest), flush=True)


if __name__ == "__main__":
  main()

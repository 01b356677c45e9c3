"""How much one core slows down while the other core computes too: bench/machines.py's ceiling is timed on one core
with the other idle, but its two nodes compute at once, so on a host whose cores share memory bandwidth (or are a
hypervisor's siblings) the ceiling overstates what two nodes can reach.

Each round times a decode-sized matrix product chain (90 products of SmolLM2's MLP shape, `rows` rows) on core 0,
alone and then while a process pinned to core 1 runs the same products without pause; it prints each ratio and
their median. BLAS runs one thread per process, as bench/machines.py runs each node.

    python bench/cores.py --rounds 4
"""
import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy: its threads would otherwise start on the parent's core
os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

PRODUCTS = 90  # 30 layers x 3 products of the MLP's shape


def weights():
  return [np.random.rand(576, 1536).astype(np.float32) for _ in range(PRODUCTS)]


def chain_ms(rows: int, repeats: int = 30) -> float:
  """Median milliseconds of one pass of the chain on this process's core."""
  ws, x, times = weights(), np.random.rand(rows, 576).astype(np.float32), []
  for _ in range(repeats):
    start = time.perf_counter()
    for w in ws:
      x @ w
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def keep_busy() -> None:
  os.sched_setaffinity(0, {1})
  ws, x = weights(), np.random.rand(8, 576).astype(np.float32)
  while True:
    for w in ws:
      x @ w


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rounds", type=int, default=4)
  p.add_argument("--rows", default="8,16")
  p.add_argument("--busy", action="store_true", help=argparse.SUPPRESS)  # the child that keeps core 1 busy
  args = p.parse_args()
  if args.busy:
    keep_busy()
  os.sched_setaffinity(0, {0})
  ratios = []
  for round_ in range(args.rounds):
    for rows in (int(r) for r in args.rows.split(",")):
      alone = chain_ms(rows)
      busy = subprocess.Popen([sys.executable, __file__, "--busy"])
      try:
        time.sleep(1)  # the child has started computing
        both = chain_ms(rows)
      finally:
        busy.kill()
        busy.wait()
      ratios.append(both / alone)
      print(f"round {round_} rows {rows}: core 0 alone {alone:.1f} ms, with core 1 busy {both:.1f} ms ({both / alone:.2f}x)", flush=True)
  print(f"median: {statistics.median(ratios):.2f}x slower with the other core busy")


if __name__ == "__main__":
  main()

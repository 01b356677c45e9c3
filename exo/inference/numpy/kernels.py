"""The numpy engine's kernels: weight products, and work shared among the cores.

A weight is kept once, as an (in, out) row-major matrix, and `x @ w` is a plain OpenBLAS sgemm whatever the rows.
On this 2-core EPYC VM that is the fastest form from 1 row to 512 (bench/products.py measures it; it also measures
the 32-column blocked layout this engine used before, which no row count favours once the weights come from memory
rather than cache).

OpenBLAS runs single-threaded here (see engine.py): its own threads spin between calls, which on a shared machine
made steps several times slower. The engine shares work itself: `split_over_cores` hands slices of a task to worker
threads, one per extra core, started on first use."""
import os
import threading
from typing import Callable, List, Optional

import numpy as np

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _Worker:
  """A thread that runs one slice of a task when handed one. A pair of locks hands it over: waking a thread costs
  about 25 us on this VM, and a thread pool's futures and queues cost as much again on top."""

  def __init__(self):
    self.go, self.done = threading.Lock(), threading.Lock()
    self.go.acquire()
    self.done.acquire()
    self.task, self.error = None, None
    threading.Thread(target=self._loop, daemon=True, name="numpy-worker").start()

  def _loop(self) -> None:
    while True:
      self.go.acquire()
      part, lo, hi = self.task
      try:
        part(lo, hi)
      except BaseException as e:  # handed to the caller by wait()
        self.error = e
      self.done.release()

  def start(self, part: Callable[[int, int], None], lo: int, hi: int) -> None:
    self.task, self.error = (part, lo, hi), None
    self.go.release()

  def wait(self) -> Optional[BaseException]:
    self.done.acquire()
    return self.error


_workers: Optional[List[_Worker]] = None
_workers_busy = threading.Lock()  # one split task at a time; another engine's thread in this process meanwhile runs alone
_starting = threading.Lock()


def _get_workers() -> List[_Worker]:
  global _workers
  if _workers is None:
    with _starting:
      if _workers is None:
        _workers = [_Worker() for _ in range(CORES - 1)]
  return _workers


def _forget_workers() -> None:
  global _workers, _workers_busy, _starting
  _workers, _workers_busy, _starting = None, threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_workers)  # a forked child has none of its parent's threads to hand work to


def split_over_cores(part: Callable[[int, int], None], n: int) -> None:
  """part(lo, hi) for each of CORES even slices of range(n), at once; the calling thread runs the first slice."""
  workers = _get_workers() if CORES > 1 and n > 1 else []
  if not workers or not _workers_busy.acquire(blocking=False):
    part(0, n)
    return
  try:
    bounds = [n * i // CORES for i in range(CORES + 1)]
    for worker, lo, hi in zip(workers, bounds[1:], bounds[2:]):
      worker.start(part, lo, hi)
    part(bounds[0], bounds[1])
  finally:
    errors = [worker.wait() for worker in workers]
    _workers_busy.release()
  for error in errors:
    if error is not None:
      raise error


PARALLEL_ROWS = 4  # from this many rows a product's columns are shared among the cores (bench/products.py: 2 rows gain nothing)
COLUMN_ALIGN = 64  # slices of whole 64-column panels, so that each core's share keeps sgemm's blocking


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """x (rows, in) @ w (in, out), its columns shared among the cores when there are rows enough."""
  rows, n_out = x.shape[0], w.shape[1]
  if rows < PARALLEL_ROWS or CORES < 2:
    return x @ w
  out = np.empty((rows, n_out), dtype=np.float32)
  panels = -(-n_out // COLUMN_ALIGN)

  def part(lo: int, hi: int) -> None:
    a, b = lo * COLUMN_ALIGN, min(n_out, hi * COLUMN_ALIGN)
    if a < b:
      np.matmul(x, w[:, a:b], out=out[:, a:b])

  split_over_cores(part, panels)
  return out

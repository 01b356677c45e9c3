"""The numpy engine's kernels: weight products, and work shared among the cores.

A weight is kept once, as an (in, out) row-major matrix, and `x @ w` is a plain OpenBLAS sgemm whatever the rows.
bench/products.py compares it with the 32-column blocked layout this engine used before (one small product per
block) on SmolLM2's shapes, weights coming from memory as in a real step. On this 2-core VM sgemm is 1.2-1.5x
faster from 16 rows up, and on one core (where a 1-row step runs) at every row count; the blocked form wins only
for 2-8 rows on both cores, by 0-30% depending on the shape (the head's 49152 columns most). The crossover depends
on the CPU: on an AVX-512 VM of the same kind the blocked form won at 16 rows by 25-65% (all but the head) and at
64 rows for q/k/v, o and down by 10-22%, sgemm for gate/up and the head. One copy means one layout, and this is
the one that paid where batches are on the VMs measured before it; the (out, in) layout checkpoints store is slower
still for sgemm (x @ w.T: 10-40% at 4-64 rows).

OpenBLAS runs single-threaded here (see engine.py): its own threads spin between calls, which on a shared machine
made steps several times slower. The engine shares work itself: `split_over_cores` hands slices of a task to worker
threads, one per extra core, started on first use."""
import ctypes
import os
import re
import threading
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np

from exo import settings

def single_threaded_blas(numpy_only: bool = False) -> None:
  """Run this process's OpenBLAS on one thread, unless OPENBLAS_NUM_THREADS says otherwise: the work is shared among
  the cores by `Workers`, and OpenBLAS's own threads would contend with them (and spin between calls).

  numpy_only: only the copy numpy's wheel bundles (numpy.libs), where there is one, leaving a system OpenBLAS that
  another library uses (the MLX engine on Linux binds its products to one) to its own threads."""
  if settings.env("OPENBLAS_NUM_THREADS"):
    return
  try:
    libraries = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", Path("/proc/self/maps").read_text())))
  except OSError:  # not Linux: Accelerate or MKL, nothing to do
    return
  bundled = str(Path(np.__file__).parent.with_name("numpy.libs"))
  if numpy_only and any(path.startswith(bundled) for path in libraries):
    libraries = [path for path in libraries if path.startswith(bundled)]
  for path in libraries:
    library = ctypes.CDLL(path)
    for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
      setter = getattr(library, name, None)
      if setter is not None:
        setter.argtypes = [ctypes.c_int]
        setter(1)
        break


CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# .running: this thread runs one slice of a task shared among the cores; .shared_step: its step's few-row products
# run on OpenMP's threads instead (packed.SharedDecode), so their columns are not shared out
_slices = threading.local()


def in_slice() -> bool:
  """Whether the calling thread runs one slice of a task `Workers` shares out (a worker, or the caller's own slice)."""
  return getattr(_slices, "running", False)


def step_is_shared() -> bool:
  """Whether the calling thread's step runs its few-row products on OpenMP's threads (packed.SharedDecode)."""
  return getattr(_slices, "shared_step", False)


def set_step_shared(shared: bool) -> None:
  _slices.shared_step = shared


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
    _slices.running = True
    while True:
      self.go.acquire()
      part, lo, hi = self.task
      try:
        part(lo, hi)
      except BaseException as e:  # handed to the caller by wait()
        self.error = e
      # Hold nothing of the task while idle: its closure may hold a whole model that its engine has let go.
      part = self.task = None
      self.done.release()

  def start(self, part: Callable[[int, int], None], lo: int, hi: int) -> None:
    self.task, self.error = (part, lo, hi), None
    self.go.release()

  def wait(self) -> Optional[BaseException]:
    self.done.acquire()
    error, self.error = self.error, None  # its traceback holds the task's frames
    return error


class Workers:
  """One worker thread per extra core (of `cores`, all by default), started on first use, sharing out one task at a
  time (another thread's task meanwhile runs alone, on its caller). The engine's steps share one group
  (`shared_workers`); other work has its own, so it never takes the engine's (see exo/embeddings/batcher.py)."""

  def __init__(self, cores: int = CORES):
    self.cores = cores
    self.threads: Optional[List[_Worker]] = None
    self.busy, self.starting = threading.Lock(), threading.Lock()

  def get(self) -> List[_Worker]:
    if self.threads is None:
      with self.starting:
        if self.threads is None:
          self.threads = [_Worker() for _ in range(self.cores - 1)]
    return self.threads

  def split(self, part: Callable[[int, int], None], n: int) -> None:
    """part(lo, hi) for each of `cores` even slices of range(n), at once; the calling thread runs the first slice."""
    workers = self.get() if self.cores > 1 and n > 1 else []
    if not workers or not self.busy.acquire(blocking=False):
      part(0, n)
      return
    try:
      bounds = [n * i // self.cores for i in range(self.cores + 1)]
      for worker, lo, hi in zip(workers, bounds[1:], bounds[2:]):
        worker.start(part, lo, hi)
      _slices.running = True
      part(bounds[0], bounds[1])
    finally:
      _slices.running = False
      errors = [worker.wait() for worker in workers]
      self.busy.release()
    for error in errors:
      if error is not None:
        raise error


shared_workers = Workers()


def _forget_workers() -> None:
  global shared_workers
  shared_workers = Workers()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_forget_workers)  # a forked child has none of its parent's threads to hand work to


def split_over_cores(part: Callable[[int, int], None], n: int, workers: Optional[Workers] = None) -> None:
  """part(lo, hi) for each of CORES even slices of range(n), at once, on `workers` (the engine's shared ones by default)."""
  (workers or shared_workers).split(part, n)


PARALLEL_ROWS = 2  # from 2 rows a step shares its work among the cores (2 rows: 20% faster; 1 row, memory-bound: 20% slower)


def split_columns(part: Callable[[int, int], None], n_cols: int, align: int, rows: int, workers: Optional[Workers] = None) -> None:
  """part(a, b) over slices of range(n_cols) cut at multiples of `align`, shared among the cores if rows are enough."""
  panels = -(-n_cols // align)

  def run(lo: int, hi: int) -> None:
    if lo < hi:
      part(lo * align, min(n_cols, hi * align))
  if rows >= PARALLEL_ROWS and not step_is_shared():
    split_over_cores(run, panels, workers)
  else:
    run(0, panels)


def matmul(x: np.ndarray, w: np.ndarray, bias: Optional[np.ndarray] = None, workers: Optional[Workers] = None,
           then: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> np.ndarray:
  """x (rows, in) @ w (in, out) (+ bias, then `then` of it, elementwise), its columns shared among the cores when
  there are rows enough: each core adds the bias and applies `then` to its own columns."""
  out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)

  def part(a: int, b: int) -> None:
    np.matmul(x, w[:, a:b], out=out[:, a:b])
    if bias is not None:
      out[:, a:b] += bias[a:b]
    if then is not None:
      out[:, a:b] = then(out[:, a:b])
  split_columns(part, w.shape[1], 64, x.shape[0], workers)
  return out


# --- weights: float32 (in, out) arrays, or quantized (packed.py); every weight product of the model goes through here

def weight_matrix(w, order: Optional[np.ndarray] = None):
  """A loaded (out, in) weight as the engine computes with it, its outputs in `order` if given: float32 as an (in,
  out) array; a QuantizedWeight the kernels run kept packed (rows = outputs), any other dequantised; parts quantized
  differently (a tuple) dequantised and joined."""
  from exo.inference.quantized import QuantizedWeight
  if isinstance(w, tuple):
    w = np.concatenate([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in w])
  if isinstance(w, QuantizedWeight):
    from exo.inference.numpy.packed import PackedMatrix
    if not PackedMatrix.supports(w):
      w = w.dequantize()
    else:
      packed = PackedMatrix.from_quantized(w)
      return packed if order is None else packed.take_rows(order)
  if order is not None:
    w = w[order]
  return np.ascontiguousarray(w.T)


def product(x: np.ndarray, w, a: int, b: int, out: Optional[np.ndarray] = None) -> np.ndarray:
  """x (rows, in) @ the weight's output columns a..b: (rows, b - a), written into `out` if given."""
  if isinstance(w, np.ndarray):
    return np.matmul(x, w[:, a:b], out=out)
  return w.product(x, a, b, out)


def full_product(x: np.ndarray, w) -> np.ndarray:
  """x (rows, in) @ every output column of the weight, on the calling core."""
  return product(x, w, 0, w.shape[1] if isinstance(w, np.ndarray) else w.shape[0])


def weight_rows(w, ids: np.ndarray) -> np.ndarray:
  """Output rows `ids` of a weight as float32 (len(ids), in): a tied head's embedding lookups."""
  if isinstance(w, np.ndarray):
    return w[:, ids].T.copy()
  return w.rows(ids)

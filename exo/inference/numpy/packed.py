"""A quantized weight as the numpy engine keeps it: packed codes, 16-bit scales and biases, products by the compiled
kernels (kernels_c/quantized.c, native.py), or by numpy where no C compiler works.

Rows are the matrix's outputs, as checkpoints store them; a product's output columns a..b are rows a..b here, so the
engine's column slices (kernels.py) are slices of rows. Up to DIRECT_ROWS input rows a product reads the codes
directly (decode steps of a few streams: each chunk of codes turned into floats once for four input rows). Up to
PANEL_ROWS (batched decode: bound by arithmetic) the panel kernel widens a few weight rows at a time into a buffer in
the core's cache and multiplies them by every input row in registers (kernels_c/panels.c). Above (prefill; or
without the compiled kernels, at any rows), it widens a tile of weight rows at a time into float32, in a scratch
buffer each thread keeps (up to TILE_BYTES, 4 MiB), and lets BLAS multiply it (the widening paid once for all rows).
How the tile meets BLAS depends on the rows, by measurement (bench/quantized_speed.py): up to TRANSPOSED_ROWS, tile @
x.T into a transposed output; above, x @ tile.T straight into the output."""
import ctypes
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Optional, Set, Tuple

import numpy as np

from exo.inference.numpy import kernels, native
from exo.inference.quantized import QuantizedWeight

DIRECT_ROWS = 8  # SmolLM2's products one core, direct against tiles: 8 rows 0.82x the time (gate/up, down), 16 rows 1.2-1.5x
# Above DIRECT_ROWS, up to PANEL_ROWS, the panel kernel (kernels_c/panels.c: small panels of weights widened in cache
# and multiplied by every row in registers). SmolLM2's products on one core (bench/panel_speed.py --products, one run
# on a loaded machine), its time against tiles widened for BLAS: 8 rows 0.69x (the direct kernel 0.72x), 16 rows 0.72x,
# 32 rows 0.81x, 64 rows 0.88x, 128 rows 1.00x, 256 rows 0.94x.
PANEL_ROWS = 128
# From LARGE_TILE_ROWS input rows a tile as large as a core's share of a layer's matrix, up to 4 MiB: one widening
# call and one BLAS call for it (64 rows: 1.1-1.2x faster than 512 KiB tiles). Fewer rows, where BLAS reads the tile
# about as fast as it is written, take tiles that stay in a core's L2 cache.
TILE_BYTES = 4 * 2**20
SMALL_TILE_BYTES = 512 * 1024
LARGE_TILE_ROWS = 32
TRANSPOSED_ROWS = 128  # up to this many input rows the product is computed transposed (see product): one core's share of
# SmolLM2's layer products against float32, CPU time: 128 rows 0.92x transposed, 0.89x not; 192 rows 0.90x both; 256 rows
# 0.85x transposed, 0.91x not
_scratch = threading.local()  # each thread's tile, reused by every product it runs


def _half_bits(values: np.ndarray) -> tuple:
  """Scales or biases as the kernels read them, (array, table name): float16 as their bits; float32 values that are
  bfloat16 ones (the safetensors reader widens those) as bfloat16 bits; other float32 values as they are."""
  if values.dtype == np.float16:
    return values.view(np.uint16), "float16"
  values = np.ascontiguousarray(values, dtype=np.float32)
  as_bits = values.view(np.uint32)
  if not (as_bits & 0xFFFF).any():
    return (as_bits >> 16).astype(np.uint16), "bfloat16"
  return values, "float32"


def _f16_table() -> np.ndarray:
  return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _bf16_table() -> np.ndarray:
  return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


# 16-bit scales' and biases' bits read through a table of their float32 values: numpy's form (the compiled kernels
# convert them themselves where the CPU can), and E8M0 exponents
TABLES = {"float16": _f16_table(), "bfloat16": _bf16_table(), "float32": np.zeros(1, dtype=np.float32),
          # E8M0's 2 ** (e - 127), a quarter of it (the kernels take E2M1 codes as four times their values); 255 is NaN
          "e8m0": np.append(np.ldexp(np.float32(1.0), np.arange(255) - 129), np.nan).astype(np.float32)}
E2M1_TIMES_4 = np.array([0, 2, 4, 6, 8, 12, 16, 24, 0, -2, -4, -6, -8, -12, -16, -24], dtype=np.float32)
_FLOAT32 = np.dtype(np.float32)
VALUES_KIND = {"float16": 0, "float32": 1, "e8m0": 2, "bfloat16": 3}  # quantized.c's VALUES_*, by table

_lib = native.library()
_parallel = {"usable": kernels.CORES > 1 and _lib is not None and bool(_lib.has_threads())}  # False in a forked child


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=lambda: _parallel.update(usable=False))  # GNU OpenMP's threads do not survive a fork


def _shares() -> bool:
  """Whether a direct product runs on OpenMP's threads: its step chose to (SharedDecode), the kernels were built with
  OpenMP, this is not a forked child, and the caller is not one of the engine's slices (kernels.in_slice: the cores
  are shared out already). (kernels.step_is_shared and in_slice read in place: this runs for every product.)"""
  return getattr(kernels._slices, "shared_step", False) and _parallel["usable"] and not getattr(kernels._slices, "running", False)


@dataclass
class _StepTimes:
  seconds: Dict[bool, float] = field(default_factory=dict)  # shared or not -> a step's seconds (a moving average)
  warmed: Set[bool] = field(default_factory=set)  # the ways that have run their first, untimed step
  every: int = 0  # steps between two tries of the slower way
  countdown: int = 0  # steps before the next try


class SharedDecode:
  """Whether a model's few-row steps (decode, up to DIRECT_ROWS) run their direct products on OpenMP's threads, in
  place of the calling core (one row) or the engine's column slices (more). Shared, SmolLM2's one-stream step ran
  1.55x faster on a quiet 2-core VM, two streams 1.5x. With the other core busy (another process, a second engine)
  the threads wait for each other: a step ran up to 40x slower at GNU OpenMP's default spin, 4x at the
  GOMP_SPINCOUNT exo sets. So the model times its steps both ways, by rows, runs the faster, and now and then tries
  the slower way again, in case the machine's load changed: every TRY_EVERY steps, twice as seldom (up to
  TRY_AT_MOST_EVERY) each time it is still much slower. A model's first step each way counts for nothing (caches and
  pages touched the first time; shared, OpenMP's threads starting: 30-80 ms, which kept a fresh model from sharing
  until its first try)."""
  TRY_EVERY, TRY_AT_MOST_EVERY = 32, 1024
  MUCH_SLOWER = 1.5

  def __init__(self, clock=time.perf_counter):
    self.clock = clock
    self.times: Dict[int, _StepTimes] = {}  # by rows

  def choose(self, rows: int) -> Tuple[bool, bool]:
    """(whether a step of `rows` rows runs shared, whether that is the slower way, tried)"""
    times = self.times.setdefault(rows, _StepTimes(every=self.TRY_EVERY))
    for way in (False, True):  # serial first, then shared, until each has a timed step
      if way not in times.seconds:
        return way, False
    faster = times.seconds[True] < times.seconds[False]
    tried = times.countdown == 0
    return faster != tried, tried

  @contextmanager
  def step(self, rows: int, most: int = DIRECT_ROWS):
    """The step of `rows` rows run as chosen (shared or not), and timed; left unshared above `most` rows (a step the
    fused decode takes whole goes on to more rows than the direct products: fused_decode.MOST_ROWS)."""
    if rows > most or not _parallel["usable"]:
      yield
      return
    shared, tried = self.choose(rows)
    kernels.set_step_shared(shared)
    started = self.clock()
    try:
      yield
    finally:
      kernels.set_step_shared(False)
    self._record(self.times[rows], shared, tried, self.clock() - started)

  def _record(self, times: _StepTimes, shared: bool, tried: bool, took: float) -> None:
    if shared not in times.warmed:
      times.warmed.add(shared)
      return
    last = times.seconds.get(shared)
    if tried:
      much_slower = took > self.MUCH_SLOWER * times.seconds[not shared]
      times.every = min(self.TRY_AT_MOST_EVERY, 2 * times.every) if much_slower else self.TRY_EVERY
    times.countdown = times.every - 1 if tried or last is None else times.countdown - 1
    times.seconds[shared] = took if tried or last is None else last + 0.25 * (took - last)  # a try: its own time


def _no_biases(shape) -> np.ndarray:
  """Zero biases for MXFP4 (never read: the kernels and numpy's form skip them): one float32 zero seen at every place (no memory)."""
  return np.broadcast_to(np.zeros(1, dtype=np.float32), shape)


class PackedMatrix:
  """An (out, in) matrix of 4- or 8-bit codes in groups along its inputs, each group with a scale and a bias; or of
  MXFP4 codes (`fp4`: E2M1 values) with a power of two a group and no bias (zeros that take no memory)."""

  def __init__(self, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, table: str, bits: int, fp4: Optional[bool] = None):
    self.codes, self.scales = np.ascontiguousarray(codes, dtype=np.uint8), np.ascontiguousarray(scales)
    self.biases = biases if fp4 is not None else np.ascontiguousarray(biases)
    self.table_name, self.bits, self.fp4 = table, bits, fp4
    self.table = TABLES[table]
    self.shape = (self.codes.shape[0], self.codes.shape[1] * 8 // bits)
    self._description = None if _lib is None else self._described()
    self._kernel = None if _lib is None else ctypes.addressof(self._description)

  def _described(self) -> native.Matrix:
    """This matrix as the compiled kernels read it: its arrays' addresses (held by this object) and its geometry."""
    address = lambda a: a.ctypes.data
    return native.Matrix(address(self.codes), address(self.scales), None if self.fp4 is not None else address(self.biases),
                         address(self.table), self.codes.shape[0], self.shape[1], self.codes.shape[1], self.scales.shape[1],
                         self.bits, VALUES_KIND[self.table_name], 1 if self.fp4 else 0)

  @classmethod
  def supports(cls, w: QuantizedWeight) -> bool:
    return ((w.mode == "affine" and w.bits in (4, 8)) or (w.mode == "mxfp4" and w.bits == 4)) and (w.shape[1] // w.scales.shape[1]) % 2 == 0

  @classmethod
  def from_quantized(cls, w: QuantizedWeight) -> "PackedMatrix":
    codes = np.ascontiguousarray(w.packed).view(np.uint8)
    if w.mode == "mxfp4":
      return cls(codes, np.ascontiguousarray(w.scales, dtype=np.uint8), _no_biases(w.scales.shape), "e8m0", 4, True)
    scales, table = _half_bits(w.scales)
    biases, bias_table = _half_bits(w.biases)
    if bias_table != table:  # one table reads both
      scales, biases, table = w.scales.astype(np.float32), w.biases.astype(np.float32), "float32"
    return cls(codes, scales, biases, table, w.bits)

  @property
  def nbytes(self) -> int:
    return self.codes.nbytes + self.scales.nbytes + (0 if self.fp4 is not None else self.biases.nbytes)

  def take_rows(self, index: np.ndarray) -> "PackedMatrix":
    pick = lambda a: np.ascontiguousarray(a[index])
    biases = _no_biases((len(index), self.scales.shape[1])) if self.fp4 is not None else pick(self.biases)
    return PackedMatrix(pick(self.codes), pick(self.scales), biases, self.table_name, self.bits, self.fp4)

  def rows(self, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` as float32 (len(ids), in): embedding lookups."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if len(ids) and (ids.min() < 0 or ids.max() >= self.shape[0]):
      raise IndexError(f"row ids out of range 0..{self.shape[0] - 1}")
    if self._kernel is None:
      return np.concatenate([self._widened(j, j + 1) for j in ids]) if len(ids) else np.empty((0, self.shape[1]), np.float32)
    out = np.empty((len(ids), self.shape[1]), dtype=np.float32)
    _lib.dequantize_rows(self._kernel, ids.ctypes.data, len(ids), out.ctypes.data)
    return out

  def direct(self, x: np.ndarray, a: int, b: int, out: np.ndarray, shared: Optional[bool] = None) -> None:
    """out = x (rows, in) @ this matrix's rows a..b, transposed, straight from the codes: on OpenMP's threads where
    `shared` (None: as the step chose, _shares) and the kernels have them, else on the calling core. out: (rows, b -
    a) float32."""
    self._run(_lib.product_arrays, x, a, b, out, shared)

  def panels(self, x: np.ndarray, a: int, b: int, out: np.ndarray, shared: Optional[bool] = None) -> None:
    """As `direct`, by the panel kernel (kernels_c/panels.c): each weight read once for every row, widened a small
    panel at a time."""
    self._run(_lib.panel_product_arrays, x, a, b, out, shared)

  def _run(self, kernel, x: np.ndarray, a: int, b: int, out: np.ndarray, shared: Optional[bool]) -> None:
    """kernel(matrix, x, out, a, b, shared), one of the compiled products over numpy arrays. The kernel checks the
    shapes and strides itself (checked here they cost as much as a small product): only what it refuses is looked at
    here."""
    shared = _shares() if shared is None else shared and _parallel["usable"]
    status = kernel(self._kernel, x, out, a, b, shared) if x.dtype is _FLOAT32 and out.dtype is _FLOAT32 else -2
    if status == -1:
      raise MemoryError("no memory for a product's inputs")
    if status == 0:
      return
    if out.shape != (x.shape[0], b - a) or x.ndim != 2 or x.shape[1] != self.shape[1] or not 0 <= a <= b <= self.shape[0] or not len(x):
      raise ValueError(f"a product of {x.shape} inputs with rows {a}..{b} of a {self.shape} matrix into {out.shape}")
    whole = np.empty(out.shape, dtype=np.float32)
    if kernel(self._kernel, np.ascontiguousarray(x, dtype=np.float32), whole, a, b, shared):
      raise MemoryError("no memory for a product's inputs")
    out[...] = whole

  def product(self, x: np.ndarray, a: int, b: int, out: Optional[np.ndarray] = None) -> np.ndarray:
    """x (rows, in) @ this matrix's rows a..b, transposed: (rows, b - a) float32, written into `out` if given."""
    if out is None:
      out = np.empty((x.shape[0], b - a), dtype=np.float32)
    if x.shape[0] <= DIRECT_ROWS and self._kernel is not None:
      self.direct(x, a, b, out)  # (which takes x as it comes: float32 and contiguous, or converts it)
      return out
    if x.shape[0] <= PANEL_ROWS and self._kernel is not None:
      self.panels(x, a, b, out)
      return out
    x = np.ascontiguousarray(x, dtype=np.float32)
    # Many rows (prefill): x @ tile.T straight into the output; BLAS runs it nearly as fast as float32 (in, out)
    # weights once the tile is large. Fewer: BLAS multiplies the tile by the inputs transposed 1.2-2x faster than
    # the inputs by the tile transposed, so the product is computed transposed, (b - a, rows), and turned at the end.
    transposed = x.shape[0] <= TRANSPOSED_ROWS
    result = np.empty((b - a, x.shape[0]), dtype=np.float32) if transposed else out
    tile_bytes = TILE_BYTES if x.shape[0] >= LARGE_TILE_ROWS else SMALL_TILE_BYTES
    tile = self._tile(max(1, min(b - a, tile_bytes // (4 * self.shape[1]))))
    for lo in range(a, b, len(tile)):
      hi = min(b, lo + len(tile))
      widened = self._widen(lo, hi, tile)
      if transposed:
        np.matmul(widened, x.T, out=result[lo - a:hi - a])
      else:
        np.matmul(x, widened.T, out=result[:, lo - a:hi - a])
    if transposed:
      out[...] = result.T
    return out

  def _widen(self, lo: int, hi: int, tile: np.ndarray) -> np.ndarray:
    """Rows lo..hi as float32, in the tile's first rows (the compiled kernel) or a new array (numpy's form)."""
    if self._kernel is None:
      return self._widened(lo, hi)
    _lib.widen_tile(self._kernel, lo, hi, tile)
    return tile[:hi - lo]

  def _widened(self, lo: int, hi: int) -> np.ndarray:
    """Rows lo..hi as float32 by numpy (no compiled kernels): codes apart, times their group's scale, plus its bias."""
    codes = self.codes[lo:hi]
    if self.bits == 4:
      levels = np.empty((hi - lo, 2 * codes.shape[1]), dtype=np.uint8)
      levels[:, 0::2], levels[:, 1::2] = codes & 15, codes >> 4
      levels = E2M1_TIMES_4[levels] if self.fp4 else levels.astype(np.float32)
    else:
      levels = codes.astype(np.float32)
    read = lambda values: values if values.dtype == np.float32 else self.table[values]
    grouped = levels.reshape(hi - lo, self.scales.shape[1], -1) * read(self.scales[lo:hi])[..., None]
    if self.fp4 is None:
      grouped += read(self.biases[lo:hi])[..., None]
    return grouped.reshape(hi - lo, -1)

  def _tile(self, rows: int) -> np.ndarray:
    """This thread's scratch tile, (rows, in) float32, its buffer grown to the largest tile the thread has used."""
    n_in = self.shape[1]
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < rows * n_in:
      buffer = _scratch.buffer = np.empty(rows * n_in, dtype=np.float32)
    return buffer[:rows * n_in].reshape(rows, n_in)

  def dequantize(self) -> np.ndarray:
    return self.rows(np.arange(self.shape[0]))

"""Compiled kernels over quantized weights (numba): products read the packed codes directly.

A weight here is (out, in) rows of codes, 4 bits (two a byte: code 2k in the low nibble of byte k, code 2k + 1 in the
high one, MLX's order) or 8 bits (one a byte), with a scale and a bias for each group of inputs: w = scale * code +
bias. Scales and biases are 16-bit floats kept as their bits (numba has no float16) and read through `table`, the
65,536 float32 values of float16 or of bfloat16 (256 KiB: it stays in the core's cache), or float32 as they are
(a checkpoint quantized from float32 weights: a second compilation, made only when one is loaded).

The 4-bit kernels also read MXFP4 (gpt-oss's experts): with `fp4` True each code stands for an E2M1 value (None:
affine codes), the scales are E8M0 exponents (uint8) read through a table of powers of two, and the biases are zero.

`product_rows_4`/`_8` are the few-rows path (decode steps; `parallel_rows_4`/`_8` the same shared among numba's
threads, packed.SharedDecode says when): each weight row is read once from memory and used for every input row; a
group's dot product is sum(x * code) * scale + sum(x) * bias, with the 4-bit codes' even and odd inputs gathered
apart first so that a row's codes meet its inputs unit-stride. Where the groups are whole 16-code vectors and affine
(every GGUF and MLX format here but MXFP4), simd.py's explicit vectors run the loop; else the plain loops below,
which LLVM vectorises itself. A byte's two 4-bit codes are split in float32 (high = floor(byte / 16), low = byte - 16
* high, both exact): numba does integer arithmetic in 64 bits, so masks and shifts ran at half the vector width.
`dequantize_rows` writes weight rows as float32 (embedding lookups); `widen_tile_4`/`_8` write a range of them into
a tile for the many-rows path, which hands the tile to BLAS (packed.py).

Every kernel releases the GIL, so the engine's own worker threads (kernels.py) run slices of one product on several
cores at once. Handing a slice to a worker thread costs ~50 us here, as much as a 1-row product of a 576x576 matrix,
so a decode step's product may instead run whole in one call, `parallel_rows_*` sharing it among numba's OpenMP
threads (which wait spinning between calls, so a step's next product starts at once). Each kernel is cached on disk
(`cache=True`), so numba's compile time (a few seconds in all) is paid once per installation. fastmath lets LLVM
reorder the sums so that they vectorise."""
import numba
import numpy as np
from numba import types
from numba.extending import overload

from exo.inference.numpy import simd

_JIT = dict(nogil=True, cache=True, fastmath=True, error_model="numpy", boundscheck=False)
PANEL = 64  # weight rows one task of a parallel product takes


def _f16_table() -> np.ndarray:
  return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _bf16_table() -> np.ndarray:
  return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


TABLES = {"float16": _f16_table(), "bfloat16": _bf16_table(), "float32": np.zeros(1, dtype=np.float32),
          # E8M0's 2 ** (e - 127), a quarter of it (_level's E2M1 values are four times theirs); 255 is NaN
          "e8m0": np.append(np.ldexp(np.float32(1.0), np.arange(255) - 129), np.nan).astype(np.float32)}


def _value(values, i, table):
  """values[i] as float32: 16-bit floats' bits (or 8-bit exponents) read through the table, float32 as they are."""


@overload(_value, inline='always')
def _value_impl(values, i, table):
  if values.dtype in (types.uint16, types.uint8):
    return lambda values, i, table: table[values[i]]
  return lambda values, i, table: values[i]


def _level(code, fp4):
  """A 4-bit code (a float32 0..15) as the value it stands for: the code itself (affine: `fp4` None); or, with `fp4`
  True, four times its E2M1 value (MXFP4: the scales' table holds a quarter of each power of two), in float steps
  without branches or lookups, which vectorise: magnitude codes m = 0, 1 are 0, 2 (0 and 0.5 times 4); m >= 2 are
  (2 + m mod 2) * 2 ** floor(m / 2), the power e * e - e + 2 for e = 1..3; code 8 and up negative."""


@overload(_level, inline='always')
def _level_impl(code, fp4):
  if isinstance(fp4, types.NoneType):
    return lambda code, fp4: code

  def e2m1_times_4(code, fp4):
    negative = np.floor(code * np.float32(0.125))
    m = code - np.float32(8.0) * negative
    e = np.floor(m * np.float32(0.5))
    odd = m - np.float32(2.0) * e
    small = np.float32(m < np.float32(2.0))
    magnitude = small * (m + m) + (np.float32(1.0) - small) * (np.float32(2.0) + odd) * (e * e - e + np.float32(2.0))
    return magnitude * (np.float32(1.0) - np.float32(2.0) * negative)
  return e2m1_times_4


@numba.njit(**_JIT)
def _group_sums(x, n_groups):
  rows, n_in = x.shape
  group = n_in // n_groups
  sums = np.empty((rows, n_groups), dtype=np.float32)
  for r in range(rows):
    xr = x[r]
    for g in range(n_groups):
      s = np.float32(0.0)
      base = g * group
      for k in range(group):
        s += xr[base + k]
      sums[r, g] = s
  return sums


@numba.njit(**_JIT)
def _even_odd(x):
  """x's even and odd inputs apart, (rows, in / 2) each, so that the 4-bit kernels' inner loop runs unit-stride."""
  rows, n_in = x.shape
  half = n_in // 2
  even = np.empty((rows, half), dtype=np.float32)
  odd = np.empty((rows, half), dtype=np.float32)
  for r in range(rows):
    for k in range(half):
      even[r, k] = x[r, 2 * k]
      odd[r, k] = x[r, 2 * k + 1]
  return even, odd


@numba.njit(inline="always", **_JIT)
def _rows_4(even, odd, sums, codes, scales, biases, table, fp4, lo, j0, j1, out):
  """out[:, j - lo] = x @ w[j] for 4-bit weight rows j in [j0, j1), x given as its even and odd inputs."""
  rows, half = even.shape
  n_groups = scales.shape[1]
  half_group = half // n_groups
  for j in range(j0, j1):
    row, row_scales, row_biases = codes[j], scales[j], biases[j]
    for r in range(rows):
      e = even[r]
      o = odd[r]
      acc = np.float32(0.0)
      for g in range(n_groups):
        s = np.float32(0.0)
        base = g * half_group
        for k in range(half_group):  # from 0: a loop from g * half_group did not vectorise (6x slower)
          code = np.float32(row[base + k])
          high = np.floor(code * np.float32(0.0625))
          s += e[base + k] * _level(code - np.float32(16.0) * high, fp4) + o[base + k] * _level(high, fp4)
        acc += s * _value(row_scales, g, table) + sums[r, g] * _value(row_biases, g, table)
      out[r, j - lo] = acc


@numba.njit(inline="always", **_JIT)
def _rows_8(x, sums, codes, scales, biases, table, lo, j0, j1, out):
  """out[:, j - lo] = x @ w[j] for 8-bit weight rows j in [j0, j1)."""
  rows, n_in = x.shape
  n_groups = scales.shape[1]
  group = n_in // n_groups
  for j in range(j0, j1):
    row, row_scales, row_biases = codes[j], scales[j], biases[j]
    for r in range(rows):
      xr = x[r]
      acc = np.float32(0.0)
      for g in range(n_groups):
        s = np.float32(0.0)
        base = g * group
        for k in range(group):
          s += xr[base + k] * np.float32(row[base + k])
        acc += s * _value(row_scales, g, table) + sums[r, g] * _value(row_biases, g, table)
      out[r, j - lo] = acc


def _direct_rows_4(even, odd, sums, codes, scales, biases, table, fp4, lo, j0, j1, out):
  """_rows_4, by explicit vectors (simd.py) where the groups are whole vectors of codes and affine."""


@overload(_direct_rows_4, inline="always")
def _direct_rows_4_impl(even, odd, sums, codes, scales, biases, table, fp4, lo, j0, j1, out):
  if not isinstance(fp4, types.NoneType):  # MXFP4: the plain loop
    return lambda even, odd, sums, codes, scales, biases, table, fp4, lo, j0, j1, out: _rows_4(
      even, odd, sums, codes, scales, biases, table, fp4, lo, j0, j1, out)

  def affine(even, odd, sums, codes, scales, biases, table, fp4, lo, j0, j1, out):
    rows, half = even.shape
    n_groups = scales.shape[1]
    if (half // n_groups) % simd.LANES:
      _rows_4(even, odd, sums, codes, scales, biases, table, fp4, lo, j0, j1, out)
      return
    per_group = half // n_groups // simd.LANES
    for j in range(j0, j1):
      # Four input rows at a time share each chunk of codes turned into floats, then two, then one.
      for r in range(0, rows - rows % 4, 4):
        simd.dot_rows_4(codes, j, even, odd, r, scales, biases, table, sums, out, j - lo, n_groups, per_group, 4)
      if rows % 4 >= 2:
        simd.dot_rows_4(codes, j, even, odd, rows - rows % 4, scales, biases, table, sums, out, j - lo, n_groups, per_group, 2)
      if rows % 2:
        simd.dot_rows_4(codes, j, even, odd, rows - 1, scales, biases, table, sums, out, j - lo, n_groups, per_group, 1)
  return affine


@numba.njit(inline="always", **_JIT)
def _direct_rows_8(x, sums, codes, scales, biases, table, lo, j0, j1, out):
  """_rows_8, by explicit vectors (simd.py) where the groups are whole vectors of codes."""
  rows, n_in = x.shape
  n_groups = scales.shape[1]
  if (n_in // n_groups) % simd.LANES:
    _rows_8(x, sums, codes, scales, biases, table, lo, j0, j1, out)
    return
  per_group = n_in // n_groups // simd.LANES
  for j in range(j0, j1):
    for r in range(0, rows - rows % 4, 4):
      simd.dot_rows_8(codes, j, x, x, r, scales, biases, table, sums, out, j - lo, n_groups, per_group, 4)
    if rows % 4 >= 2:
      simd.dot_rows_8(codes, j, x, x, rows - rows % 4, scales, biases, table, sums, out, j - lo, n_groups, per_group, 2)
    if rows % 2:
      simd.dot_rows_8(codes, j, x, x, rows - 1, scales, biases, table, sums, out, j - lo, n_groups, per_group, 1)


@numba.njit(**_JIT)
def product_rows_4(x, codes, scales, biases, table, fp4, lo, hi, out):
  """out[:, j - lo] = x @ w[j] for weight rows j in [lo, hi). x: float32 (rows, in)."""
  even, odd = _even_odd(x)
  _direct_rows_4(even, odd, _group_sums(x, scales.shape[1]), codes, scales, biases, table, fp4, lo, lo, hi, out)


@numba.njit(**_JIT)
def product_rows_8(x, codes, scales, biases, table, fp4, lo, hi, out):
  """As product_rows_4, one code a byte (affine only: `fp4` is None)."""
  _direct_rows_8(np.ascontiguousarray(x), _group_sums(x, scales.shape[1]), codes, scales, biases, table, lo, lo, hi, out)


@numba.njit(parallel=True, **_JIT)
def parallel_rows_4(x, codes, scales, biases, table, fp4, lo, hi, out):
  """product_rows_4 on numba's threads, PANEL weight rows a task."""
  for panel in numba.prange((hi - lo + PANEL - 1) // PANEL):
    j0 = lo + panel * PANEL
    j1 = min(hi, j0 + PANEL)
    product_rows_4(x, codes, scales, biases, table, fp4, j0, j1, out[:, j0 - lo:j1 - lo])


@numba.njit(parallel=True, **_JIT)
def parallel_rows_8(x, codes, scales, biases, table, fp4, lo, hi, out):
  """product_rows_8 on numba's threads, PANEL weight rows a task."""
  for panel in numba.prange((hi - lo + PANEL - 1) // PANEL):
    j0 = lo + panel * PANEL
    j1 = min(hi, j0 + PANEL)
    product_rows_8(x, codes, scales, biases, table, fp4, j0, j1, out[:, j0 - lo:j1 - lo])


DIRECT = {4: (product_rows_4, parallel_rows_4), 8: (product_rows_8, parallel_rows_8)}  # by bits: (serial, parallel)


def _vector_widening(codes, scales, biases, out, fp4) -> bool:
  """Whether a widening compiled for these types writes by explicit vectors (simd.py): affine codes, C-contiguous
  arrays (their rows are read and written as vectors)."""
  return isinstance(fp4, types.NoneType) and all(a.layout == "C" for a in (codes, scales, biases, out))


def _widen_4(codes, scales, biases, table, fp4, lo, hi, out):
  """widen_tile_4's work."""


@overload(_widen_4, inline="always")
def _widen_4_impl(codes, scales, biases, table, fp4, lo, hi, out):
  if not _vector_widening(codes, scales, biases, out, fp4):
    return lambda codes, scales, biases, table, fp4, lo, hi, out: _widen_plain_4(codes, scales, biases, table, fp4, lo, hi, out)

  def vectors(codes, scales, biases, table, fp4, lo, hi, out):
    n_groups, n_bytes = scales.shape[1], codes.shape[1]
    if (n_bytes // n_groups) % simd.LANES:
      _widen_plain_4(codes, scales, biases, table, fp4, lo, hi, out)
      return
    for j in range(lo, hi):
      simd.widen_row_4(codes, j, scales, biases, table, out, j - lo, n_groups, n_bytes // n_groups // simd.LANES)
  return vectors


def _widen_8(codes, scales, biases, table, fp4, lo, hi, out):
  """widen_tile_8's work."""


@overload(_widen_8, inline="always")
def _widen_8_impl(codes, scales, biases, table, fp4, lo, hi, out):
  if not _vector_widening(codes, scales, biases, out, fp4):
    return lambda codes, scales, biases, table, fp4, lo, hi, out: _widen_plain_8(codes, scales, biases, table, fp4, lo, hi, out)

  def vectors(codes, scales, biases, table, fp4, lo, hi, out):
    n_groups, n_in = scales.shape[1], codes.shape[1]
    if (n_in // n_groups) % simd.LANES:
      _widen_plain_8(codes, scales, biases, table, fp4, lo, hi, out)
      return
    for j in range(lo, hi):
      simd.widen_row_8(codes, j, scales, biases, table, out, j - lo, n_groups, n_in // n_groups // simd.LANES)
  return vectors


@numba.njit(**_JIT)
def widen_tile_4(codes, scales, biases, table, fp4, lo, hi, out):
  """out[j - lo] = 4-bit row w[j] as float32 for j in [lo, hi), inputs in order: by explicit vectors (simd.py) where it
  can, 2.x faster; else as _widen_plain_4."""
  _widen_4(codes, scales, biases, table, fp4, lo, hi, out)


@numba.njit(**_JIT)
def widen_tile_8(codes, scales, biases, table, fp4, lo, hi, out):
  """out[j - lo] = 8-bit row w[j] as float32 for j in [lo, hi), inputs in order (as widen_tile_4)."""
  _widen_8(codes, scales, biases, table, fp4, lo, hi, out)


@numba.njit(inline="always", **_JIT)
def _widen_plain_4(codes, scales, biases, table, fp4, lo, hi, out):
  """out[j - lo] = 4-bit row w[j] as float32 for j in [lo, hi), inputs in order. Each group is sliced out and looped
  over from 0: numba cannot tell that an index sum is never negative, and the check it adds for one kept this loop
  from vectorising (3x slower). Writing a code's two values side by side vectorises as well as writing even and
  odd inputs apart did (0.18 against 0.22 ns a value, a 256-row tile), and the inputs need no reordering."""
  n_groups = scales.shape[1]
  half_group = codes.shape[1] // n_groups
  group = 2 * half_group
  for j in range(lo, hi):
    row, dest, row_scales, row_biases = codes[j], out[j - lo], scales[j], biases[j]
    for g in range(n_groups):
      scale, bias = _value(row_scales, g, table), _value(row_biases, g, table)
      group_codes, group_dest = row[g * half_group:(g + 1) * half_group], dest[g * group:(g + 1) * group]
      for k in range(half_group):
        code = np.float32(group_codes[k])
        high = np.floor(code * np.float32(0.0625))
        group_dest[2 * k] = _level(code - np.float32(16.0) * high, fp4) * scale + bias
        group_dest[2 * k + 1] = _level(high, fp4) * scale + bias


@numba.njit(inline="always", **_JIT)
def _widen_plain_8(codes, scales, biases, table, fp4, lo, hi, out):
  """As _widen_plain_4, one code a byte."""
  n_groups = scales.shape[1]
  group = codes.shape[1] // n_groups
  for j in range(lo, hi):
    row, dest, row_scales, row_biases = codes[j], out[j - lo], scales[j], biases[j]
    for g in range(n_groups):
      scale, bias = _value(row_scales, g, table), _value(row_biases, g, table)
      at = slice(g * group, (g + 1) * group)
      group_codes, group_dest = row[at], dest[at]
      for k in range(group):
        group_dest[k] = np.float32(np.int32(group_codes[k])) * scale + bias


@numba.njit(**_JIT)
def dequantize_rows(codes, scales, biases, table, fp4, bits, ids, out):
  """out[i] = w[ids[i]] as float32; out is (len(ids), in)."""
  for i in range(ids.shape[0]):
    j = ids[i]
    if bits == 4:
      widen_tile_4(codes, scales, biases, table, fp4, j, j + 1, out[i:i + 1])
    else:
      widen_tile_8(codes, scales, biases, table, fp4, j, j + 1, out[i:i + 1])

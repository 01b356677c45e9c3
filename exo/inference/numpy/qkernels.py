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
apart first so that a row's codes meet its inputs unit-stride. Where the groups are whole 16-code vectors (every GGUF,
MLX and MXFP4 format here), explicit vectors (dot_rows) run the loop; else the plain loops below,
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
import numpy as np
from llvmlite import ir

from exo.inference.numpy.jit import numba  # first: numba's compiler started without SciPy
from numba import types  # noqa: E402 (after the line above)
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic, overload  # noqa: E402

_JIT = dict(nogil=True, cache=True, fastmath=True, error_model="numpy", boundscheck=False)
PANEL = 64  # weight rows one task of a parallel product takes


def _f16_table() -> np.ndarray:
  return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def _bf16_table() -> np.ndarray:
  return (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)


TABLES = {"float16": _f16_table(), "bfloat16": _bf16_table(), "float32": np.zeros(1, dtype=np.float32),
          # E8M0's 2 ** (e - 127), a quarter of it (_level's E2M1 values are four times theirs); 255 is NaN
          "e8m0": np.append(np.ldexp(np.float32(1.0), np.arange(255) - 129), np.nan).astype(np.float32)}


# --- explicit vectors (numba intrinsics that emit LLVM IR) ---
#
# LLVM vectorised the plain loops below over one group of inputs at a time and then reduced the group's vector to one
# number before applying its scale: for 32-input groups that reduction cost as much as the products themselves. The
# intrinsics run a weight row's whole dot product in one 16-lane accumulator (LLVM's portable <16 x float>, lowered
# to AVX-512, AVX2 or NEON): each group's partial products are scaled as a vector and added, the lanes summed once a
# row (a 1-row product of SmolLM2's gate/up 1.65x faster on one core). They live in this file because numba's disk
# cache notices only a change to the file a cached function is in: kernels calling intrinsics from another module
# would go on running the old ones after that module changed.

LANES = 16
_f32 = ir.FloatType()
_vf = ir.VectorType(_f32, LANES)
_vi8 = ir.VectorType(ir.IntType(8), LANES)


def _item(context, builder, array_type, array, indices):
  """A pointer to array[indices] (any layout; a row read as a vector must be contiguous)."""
  a = context.make_array(array_type)(context, builder, array)
  shape, strides = cgutils.unpack_tuple(builder, a.shape), cgutils.unpack_tuple(builder, a.strides)
  return cgutils.get_item_pointer2(context, builder, data=a.data, shape=shape, strides=strides, layout=array_type.layout, inds=indices)


def _vector(builder, pointer, offset, vector_type):
  return builder.load(builder.bitcast(builder.gep(pointer, [offset]), vector_type.as_pointer()), align=1)


def _ir_value(builder, values, values_type, table, g):
  """values[g] as float32: 16-bit floats' bits read through the table, float32 as it is."""
  value = builder.load(builder.gep(values, [g]))
  if values_type.dtype == types.float32:
    return value
  return builder.load(builder.gep(table, [builder.zext(value, ir.IntType(64))]))


def _splat(builder, value):
  lanes = builder.insert_element(ir.Constant(_vf, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
  return builder.shuffle_vector(lanes, ir.Constant(_vf, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


def _e2m1_times_4(builder, code):
  """4-bit codes (floats 0..15) as four times their E2M1 values (MXFP4; _level's arithmetic, by vectors)."""
  c = lambda v: ir.Constant(_vf, [v] * LANES)
  floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_vf, [_vf]), "llvm.floor.v16f32")
  negative = builder.call(floor, [builder.fmul(code, c(0.125))])
  m = builder.fsub(code, builder.fmul(negative, c(8.0)))
  e = builder.call(floor, [builder.fmul(m, c(0.5))])
  odd = builder.fsub(m, builder.fmul(e, c(2.0)))
  large = builder.fmul(builder.fadd(odd, c(2.0)), builder.fadd(builder.fsub(builder.fmul(e, e), e), c(2.0)))
  magnitude = builder.select(builder.fcmp_ordered("<", m, c(2.0)), builder.fadd(m, m), large)
  return builder.fmul(magnitude, builder.fsub(c(1.0), builder.fmul(negative, c(2.0))))


def _block_dot(context, builder, args, types_, bits, rows):
  """For `rows` input rows at once, sum over groups g of scale_g * (the group's products) + bias_g * sums[g], into
  out; see dot_rows. A chunk's codes are turned into floats once for all the rows."""
  codes, j, x_a, x_b, first, scales, biases, table, sums, out, column, n_groups, per_group, _, _ = args
  fp4 = not isinstance(types_[13], types.NoneType)
  module = builder.module
  fma = cgutils.get_or_insert_function(module, ir.FunctionType(_vf, [_vf, _vf, _vf]), "llvm.fma.v16f32")
  floor = cgutils.get_or_insert_function(module, ir.FunctionType(_vf, [_vf]), "llvm.floor.v16f32")
  reduce = cgutils.get_or_insert_function(module, ir.FunctionType(_f32, [_f32, _vf]), "llvm.vector.reduce.fadd.v16f32")
  zero = ir.Constant(first.type, 0)
  row = [builder.add(first, ir.Constant(first.type, r)) for r in range(rows)]
  code_p = _item(context, builder, types_[0], codes, [j, zero])
  a_p = [_item(context, builder, types_[2], x_a, [row[r], zero]) for r in range(rows)]
  b_p = [_item(context, builder, types_[3], x_b, [row[r], zero]) for r in range(rows)] if bits == 4 else None
  scale_p, bias_p = (_item(context, builder, types_[i], arg, [j, zero]) for i, arg in ((5, scales), (6, biases)))
  table_p = _item(context, builder, types_[7], table, [zero])
  sums_p = [_item(context, builder, types_[8], sums, [row[r], zero]) for r in range(rows)]
  zeros = ir.Constant(_vf, [0.0] * LANES)
  lanes = [cgutils.alloca_once_value(builder, zeros) for _ in range(rows)]
  offsets = [cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0)) for _ in range(rows)]
  parts = [cgutils.alloca_once_value(builder, zeros) for _ in range(rows)]
  step = ir.Constant(per_group.type, LANES)

  def chunk(at):
    """16 bytes of codes from `at` into each row's partial products for the group."""
    codes_f = builder.uitofp(_vector(builder, code_p, at, _vi8), _vf)
    if bits == 4:  # a byte's low code times the even input, its high code times the odd one
      high = builder.call(floor, [builder.fmul(codes_f, ir.Constant(_vf, [1 / 16] * LANES))])
      low = builder.fsub(codes_f, builder.fmul(high, ir.Constant(_vf, [16.0] * LANES)))
      if fp4:
        high, low = _e2m1_times_4(builder, high), _e2m1_times_4(builder, low)
    for r in range(rows):
      a = _vector(builder, a_p[r], at, _vf)
      if bits == 4:
        b = _vector(builder, b_p[r], at, _vf)
        builder.store(builder.call(fma, [b, high, builder.call(fma, [a, low, builder.load(parts[r])])]), parts[r])
      else:
        builder.store(builder.call(fma, [a, codes_f, builder.load(parts[r])]), parts[r])

  one_chunk = builder.icmp_unsigned("==", per_group, ir.Constant(per_group.type, 1))
  with cgutils.for_range(builder, n_groups) as group:
    g = group.index
    for part in parts:
      builder.store(zeros, part)
    with builder.if_else(one_chunk) as (single, several):  # 32-input groups (GGUF's blocks) without a loop
      with single:
        chunk(builder.mul(g, step))
      with several:
        with cgutils.for_range(builder, per_group) as c:
          chunk(builder.mul(builder.add(builder.mul(g, per_group), c.index), step))
    scale = _splat(builder, _ir_value(builder, scale_p, types_[5], table_p, g))
    for r in range(rows):
      builder.store(builder.call(fma, [builder.load(parts[r]), scale, builder.load(lanes[r])]), lanes[r])
      if not fp4:  # MXFP4 has no biases (its array of zeros takes no memory, and is not read)
        bias = _ir_value(builder, bias_p, types_[6], table_p, g)
        builder.store(builder.fadd(builder.load(offsets[r]), builder.fmul(bias, builder.load(builder.gep(sums_p[r], [g])))), offsets[r])
  for r in range(rows):
    total = builder.call(reduce, [ir.Constant(_f32, 0.0), builder.load(lanes[r])], fastmath=("reassoc",))
    builder.store(builder.fadd(total, builder.load(offsets[r])), _item(context, builder, types_[9], out, [row[r], column]))
  return context.get_dummy_value()


def _widen(context, builder, args, types_, bits):
  """Weight row j as float32: out[row, i] = scale * code_i + bias, inputs in order; see widen_row_4/_8."""
  codes, j, scales, biases, table, out, row, n_groups, per_group, _ = args
  fp4 = not isinstance(types_[9], types.NoneType)
  zero = ir.Constant(j.type, 0)
  code_p = _item(context, builder, types_[0], codes, [j, zero])
  scale_p, bias_p = (_item(context, builder, types_[i], arg, [j, zero]) for i, arg in ((2, scales), (3, biases)))
  table_p = _item(context, builder, types_[4], table, [zero])
  out_p = _item(context, builder, types_[5], out, [row, zero])
  floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_vf, [_vf]), "llvm.floor.v16f32")
  step = ir.Constant(per_group.type, LANES)
  interleave = ir.Constant(ir.VectorType(ir.IntType(32), 2 * LANES), [i // 2 + (LANES if i % 2 else 0) for i in range(2 * LANES)])
  with cgutils.for_range(builder, n_groups) as group:
    g = group.index
    scale = _splat(builder, _ir_value(builder, scale_p, types_[2], table_p, g))
    bias = _splat(builder, ir.Constant(_f32, 0.0) if fp4 else _ir_value(builder, bias_p, types_[3], table_p, g))  # MXFP4: no biases
    with cgutils.for_range(builder, per_group) as chunk:
      at = builder.mul(builder.add(builder.mul(g, per_group), chunk.index), step)
      codes_f = builder.uitofp(_vector(builder, code_p, at, _vi8), _vf)
      if bits == 4:  # a byte's low code is the even input's, its high code the odd one's
        high = builder.call(floor, [builder.fmul(codes_f, ir.Constant(_vf, [1 / 16] * LANES))])
        low = builder.fsub(codes_f, builder.fmul(high, ir.Constant(_vf, [16.0] * LANES)))
        if fp4:
          high, low = _e2m1_times_4(builder, high), _e2m1_times_4(builder, low)
        pairs = builder.shuffle_vector(builder.fadd(builder.fmul(low, scale), bias), builder.fadd(builder.fmul(high, scale), bias), interleave)
        builder.store(pairs, builder.bitcast(builder.gep(out_p, [builder.add(at, at)]), pairs.type.as_pointer()), align=4)
      else:
        builder.store(builder.fadd(builder.fmul(codes_f, scale), bias), builder.bitcast(builder.gep(out_p, [at]), _vf.as_pointer()), align=4)
  return context.get_dummy_value()


@intrinsic
def widen_row_4(typingctx, codes, j, scales, biases, table, out, row, n_groups, per_group, fp4):
  """4-bit weight row j (codes[j]: n_groups groups of per_group * 16 bytes) as float32 into out[row]: scale * code +
  bias, scales[j] and biases[j] 16-bit bits through table, or float32 (fp4 not None: MXFP4, the module's docstring).
  The rows read and written contiguous."""
  sig = types.none(codes, j, scales, biases, table, out, row, n_groups, per_group, fp4)
  return sig, lambda context, builder, signature, args: _widen(context, builder, args, signature.args, 4)


@intrinsic
def widen_row_8(typingctx, codes, j, scales, biases, table, out, row, n_groups, per_group, fp4):
  """As widen_row_4 for an 8-bit row, one code a byte (affine: fp4 None)."""
  sig = types.none(codes, j, scales, biases, table, out, row, n_groups, per_group, fp4)
  return sig, lambda context, builder, signature, args: _widen(context, builder, args, signature.args, 8)


def _dot_signature(args):
  rows = args[-1]
  if not isinstance(rows, types.IntegerLiteral):
    return None  # numba asks again with the literal: the rows are unrolled
  return types.none(*args)


@intrinsic
def dot_rows(typingctx, codes, j, x_a, x_b, first, scales, biases, table, sums, out, column, n_groups, per_group, fp4, rows):
  """Weight row j's dot products with `rows` (a literal) input rows from `first`, into out[first + r, column]: codes[j]
  in n_groups groups of per_group * 16 bytes, 4-bit (two a byte) where x_b is given, the inputs' even halves in x_a and
  odd ones in x_b, or 8-bit (one a byte) where x_b is None, the inputs as they are in x_a; scales[j] and biases[j]
  (16-bit bits through table, or float32); sums[first + r]: the inputs' group sums. Rows of codes, inputs, scales,
  biases and sums contiguous. fp4 not None: MXFP4 codes (the module's docstring)."""
  args = (codes, j, x_a, x_b, first, scales, biases, table, sums, out, column, n_groups, per_group, fp4, rows)
  sig = _dot_signature(args)
  bits = 8 if isinstance(x_b, types.NoneType) else 4
  return None if sig is None else (sig, lambda context, builder, signature, a: _block_dot(context, builder, a, signature.args, bits, rows.literal_value))


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


@numba.njit(inline="always", **_JIT)
def _vector_dot(x_a, x_b, sums, codes, scales, biases, table, fp4, lo, j0, j1, out):
  """out[:, j - lo] = x @ w[j] for weight rows j in [j0, j1) by dot_rows (x_a, x_b as it takes them): four input rows
  at a time share each chunk of codes turned into floats, then two, then one."""
  rows, n_groups = x_a.shape[0], scales.shape[1]
  per_group = x_a.shape[1] // n_groups // LANES
  for j in range(j0, j1):
    for r in range(0, rows - rows % 4, 4):
      dot_rows(codes, j, x_a, x_b, r, scales, biases, table, sums, out, j - lo, n_groups, per_group, fp4, 4)
    if rows % 4 >= 2:
      dot_rows(codes, j, x_a, x_b, rows - rows % 4, scales, biases, table, sums, out, j - lo, n_groups, per_group, fp4, 2)
    if rows % 2:
      dot_rows(codes, j, x_a, x_b, rows - 1, scales, biases, table, sums, out, j - lo, n_groups, per_group, fp4, 1)


@numba.njit(**_JIT)
def product_rows_4(x, codes, scales, biases, table, fp4, lo, hi, out):
  """out[:, j - lo] = x @ w[j] for weight rows j in [lo, hi). x: float32 (rows, in). By explicit vectors where the
  groups are whole vectors of codes, else by _rows_4."""
  even, odd = _even_odd(x)
  sums = _group_sums(x, scales.shape[1])
  if (even.shape[1] // scales.shape[1]) % LANES:
    _rows_4(even, odd, sums, codes, scales, biases, table, fp4, lo, lo, hi, out)
  else:
    _vector_dot(even, odd, sums, codes, scales, biases, table, fp4, lo, lo, hi, out)


@numba.njit(**_JIT)
def product_rows_8(x, codes, scales, biases, table, fp4, lo, hi, out):
  """As product_rows_4, one code a byte (affine only: `fp4` is None)."""
  x = np.ascontiguousarray(x)
  sums = _group_sums(x, scales.shape[1])
  if (x.shape[1] // scales.shape[1]) % LANES:
    _rows_8(x, sums, codes, scales, biases, table, lo, lo, hi, out)
  else:
    _vector_dot(x, None, sums, codes, scales, biases, table, None, lo, lo, hi, out)


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


@numba.njit(inline="always", **_JIT)
def _vector_rows(codes, scales, out) -> bool:
  """Whether the rows a widening reads and writes lie contiguous, as the explicit vectors read and write them."""
  return codes.strides[1] == 1 and scales.strides[1] == scales.itemsize and out.strides[1] == 4


@numba.njit(**_JIT)
def widen_tile_4(codes, scales, biases, table, fp4, lo, hi, out):
  """out[j - lo] = 4-bit row w[j] as float32 for j in [lo, hi), inputs in order: by explicit vectors (widen_row_4) where
  it can (1.65x faster), else as _widen_plain_4."""
  n_groups, n_bytes = scales.shape[1], codes.shape[1]
  if (n_bytes // n_groups) % LANES or not _vector_rows(codes, scales, out):
    _widen_plain_4(codes, scales, biases, table, fp4, lo, hi, out)
    return
  for j in range(lo, hi):
    widen_row_4(codes, j, scales, biases, table, out, j - lo, n_groups, n_bytes // n_groups // LANES, fp4)


@numba.njit(**_JIT)
def widen_tile_8(codes, scales, biases, table, fp4, lo, hi, out):
  """out[j - lo] = 8-bit row w[j] as float32 for j in [lo, hi), inputs in order (as widen_tile_4)."""
  n_groups, n_in = scales.shape[1], codes.shape[1]
  if (n_in // n_groups) % LANES or not _vector_rows(codes, scales, out):
    _widen_plain_8(codes, scales, biases, table, fp4, lo, hi, out)
    return
  for j in range(lo, hi):
    widen_row_8(codes, j, scales, biases, table, out, j - lo, n_groups, n_in // n_groups // LANES, None)


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

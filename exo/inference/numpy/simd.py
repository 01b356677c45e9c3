"""Explicit vector code for the quantized kernels' inner loops (numba intrinsics that emit LLVM IR).

LLVM vectorised qkernels' plain loops over one group of inputs at a time and then reduced the group's vector to one
number before applying its scale: for 32-input groups that reduction cost as much as the products themselves. Here a
weight row's whole dot product runs in one 16-lane accumulator (LLVM's portable <16 x float>, which it lowers to
AVX-512, AVX2 or NEON): each group's partial products are scaled as a vector and added, and the lanes are summed
once per row. A 1-row product of SmolLM2's gate/up ran 1.65x faster on one core."""
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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


def _value(builder, values, values_type, table, g):
  """values[g] as float32: 16-bit floats' bits read through the table, float32 as it is."""
  value = builder.load(builder.gep(values, [g]))
  if values_type.dtype == types.float32:
    return value
  return builder.load(builder.gep(table, [builder.zext(value, ir.IntType(64))]))


def _splat(builder, value):
  lanes = builder.insert_element(ir.Constant(_vf, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
  return builder.shuffle_vector(lanes, ir.Constant(_vf, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), LANES), [0] * LANES))


def _block_dot(context, builder, args, types_, bits, rows):
  """For `rows` input rows at once, sum over groups g of scale_g * (the group's products) + bias_g * sums[g], into
  out; see dot_rows_4. A chunk's codes are turned into floats once for all the rows."""
  codes, j, x_a, x_b, first, scales, biases, table, sums, out, column, n_groups, per_group, _ = args
  module = builder.module
  fma = cgutils.get_or_insert_function(module, ir.FunctionType(_vf, [_vf, _vf, _vf]), "llvm.fma.v16f32")
  floor = cgutils.get_or_insert_function(module, ir.FunctionType(_vf, [_vf]), "llvm.floor.v16f32")
  reduce = cgutils.get_or_insert_function(module, ir.FunctionType(_f32, [_f32, _vf]), "llvm.vector.reduce.fadd.v16f32")
  zero = ir.Constant(first.type, 0)
  row = [builder.add(first, ir.Constant(first.type, r)) for r in range(rows)]
  code_p = _item(context, builder, types_[0], codes, [j, zero])
  a_p = [_item(context, builder, types_[2], x_a, [row[r], zero]) for r in range(rows)]
  b_p = [_item(context, builder, types_[3], x_b, [row[r], zero]) for r in range(rows)]
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
    scale = _splat(builder, _value(builder, scale_p, types_[5], table_p, g))
    bias = _value(builder, bias_p, types_[6], table_p, g)
    for r in range(rows):
      builder.store(builder.call(fma, [builder.load(parts[r]), scale, builder.load(lanes[r])]), lanes[r])
      builder.store(builder.fadd(builder.load(offsets[r]), builder.fmul(bias, builder.load(builder.gep(sums_p[r], [g])))), offsets[r])
  for r in range(rows):
    total = builder.call(reduce, [ir.Constant(_f32, 0.0), builder.load(lanes[r])], fastmath=("reassoc",))
    builder.store(builder.fadd(total, builder.load(offsets[r])), _item(context, builder, types_[9], out, [row[r], column]))
  return context.get_dummy_value()


def _widen(context, builder, args, types_, bits):
  """Weight row j as float32: out[row, i] = scale * code_i + bias, inputs in order; see widen_row_4/_8."""
  codes, j, scales, biases, table, out, row, n_groups, per_group = args
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
    scale = _splat(builder, _value(builder, scale_p, types_[2], table_p, g))
    bias = _splat(builder, _value(builder, bias_p, types_[3], table_p, g))
    with cgutils.for_range(builder, per_group) as chunk:
      at = builder.mul(builder.add(builder.mul(g, per_group), chunk.index), step)
      codes_f = builder.uitofp(_vector(builder, code_p, at, _vi8), _vf)
      if bits == 4:  # a byte's low code is the even input's, its high code the odd one's
        high = builder.call(floor, [builder.fmul(codes_f, ir.Constant(_vf, [1 / 16] * LANES))])
        low = builder.fsub(codes_f, builder.fmul(high, ir.Constant(_vf, [16.0] * LANES)))
        pairs = builder.shuffle_vector(builder.fadd(builder.fmul(low, scale), bias), builder.fadd(builder.fmul(high, scale), bias), interleave)
        builder.store(pairs, builder.bitcast(builder.gep(out_p, [builder.add(at, at)]), pairs.type.as_pointer()), align=4)
      else:
        builder.store(builder.fadd(builder.fmul(codes_f, scale), bias), builder.bitcast(builder.gep(out_p, [at]), _vf.as_pointer()), align=4)
  return context.get_dummy_value()


@intrinsic
def widen_row_4(typingctx, codes, j, scales, biases, table, out, row, n_groups, per_group):
  """4-bit weight row j (codes[j]: n_groups groups of per_group * 16 bytes) as float32 into out[row]: scale * code +
  bias, scales[j] and biases[j] 16-bit bits through table, or float32. The rows read and written contiguous."""
  sig = types.none(codes, j, scales, biases, table, out, row, n_groups, per_group)
  return sig, lambda context, builder, signature, args: _widen(context, builder, args, signature.args, 4)


@intrinsic
def widen_row_8(typingctx, codes, j, scales, biases, table, out, row, n_groups, per_group):
  """As widen_row_4 for an 8-bit row, one code a byte."""
  sig = types.none(codes, j, scales, biases, table, out, row, n_groups, per_group)
  return sig, lambda context, builder, signature, args: _widen(context, builder, args, signature.args, 8)


def _dot_signature(args):
  rows = args[-1]
  if not isinstance(rows, types.IntegerLiteral):
    return None  # numba asks again with the literal: the rows are unrolled
  return types.none(*args)


@intrinsic
def dot_rows_4(typingctx, codes, j, even, odd, first, scales, biases, table, sums, out, column, n_groups, per_group, rows):
  """4-bit weight row j's dot products with `rows` (a literal) input rows from `first`, into out[first + r, column]:
  codes[j] (two a byte), n_groups groups of per_group * 16 bytes; the inputs' even and odd halves; scales[j] and
  biases[j] (16-bit bits through table, or float32); sums[first + r]: the inputs' group sums. Rows of codes, even,
  odd, scales, biases and sums contiguous."""
  args = (codes, j, even, odd, first, scales, biases, table, sums, out, column, n_groups, per_group, rows)
  sig = _dot_signature(args)
  return None if sig is None else (sig, lambda context, builder, signature, a: _block_dot(context, builder, a, signature.args, 4, rows.literal_value))


@intrinsic
def dot_rows_8(typingctx, codes, j, x, unused, first, scales, biases, table, sums, out, column, n_groups, per_group, rows):
  """As dot_rows_4 for an 8-bit row (one code a byte) and the inputs as they are; `unused` is not read."""
  args = (codes, j, x, unused, first, scales, biases, table, sums, out, column, n_groups, per_group, rows)
  sig = _dot_signature(args)
  return None if sig is None else (sig, lambda context, builder, signature, a: _block_dot(context, builder, a, signature.args, 8, rows.literal_value))

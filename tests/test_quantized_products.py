"""Quantized weights kept packed in the numpy engine: GGUF's Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks read as the
gguf package dequantises them, and every product and lookup of the compiled kernels equal to the same matrix dequantised to
float32, for each bit width, group size and scale format, on the few-rows (direct) path, the panels (batched decode; every
row count: tests/test_panel_products.py) and both tiled BLAS paths (some rows: products computed transposed; many rows:
as they are)."""
import gguf
import numpy as np
import pytest
from gguf import quants

from exo.inference.numpy import kernels, packed
from exo.inference.numpy.kernels import Workers, product, weight_matrix, weight_rows
from exo.inference.numpy.llama import interleaved_pairs
from exo.inference.numpy.packed import PackedMatrix
from exo.inference.gguf_quants import BLOCK_BYTES, from_gguf_blocks
from exo.inference.quantized import QuantizedWeight
from exo.inference.weights import _unpermute_rope

pytestmark = pytest.mark.unit

GGUF_TYPES = list(BLOCK_BYTES)
# where each type's float16 super-scales sit in a block (random bytes there could be infinities)
HALF_OFFSETS = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}
# bytes held per byte of the file (K-quants: float32 scales and biases, 5- and 6-bit codes one a byte)
HELD_PER_FILE_BYTE = {"Q4_0": 20 / 18, "Q4_1": 1.0, "Q8_0": 36 / 34, "Q4_K": 0.75 / 0.5625, "Q5_K": 1.25 / 0.6875, "Q6_K": 1.5 / 0.8203125}


def gguf_matrix(type_name: str, rows: int = 96, cols: int = 256, seed: int = 0):
  """Random blocks of the type (every code and sub-scale value occurs) with small float16 scales: the raw bytes and
  the gguf package's own dequantisation of them."""
  rng = np.random.default_rng(seed)
  kind = gguf.GGMLQuantizationType[type_name]
  raw = rng.integers(0, 256, (rows, cols // quants.GGML_QUANT_SIZES[kind][0] * BLOCK_BYTES[type_name]), dtype=np.uint8)
  blocks = raw.reshape(-1, BLOCK_BYTES[type_name])
  for at in HALF_OFFSETS[type_name]:
    blocks[:, at:at + 2] = (rng.random((len(blocks), 1)) * 0.01).astype(np.float16).view(np.uint8)
  return raw, quants.dequantize(raw, kind).reshape(rows, cols)


def mlx_matrix(bits: int, group: int, scale_dtype, rows: int = 80, cols: int = 256, seed: int = 1) -> QuantizedWeight:
  """An MLX-layout affine matrix with random codes; scales and biases exactly representable in `scale_dtype`, given
  as float32 (as the safetensors reader gives bfloat16 ones) or as float16; or float32 ones (mlx-lm's conversion
  of a float32 checkpoint)."""
  rng = np.random.default_rng(seed)
  codes = rng.integers(0, 2 ** bits, (rows, cols), dtype=np.uint32)
  packed_words = np.zeros((rows, cols * bits // 32), dtype=np.uint32)
  per_word = 32 // bits
  for i in range(per_word):
    packed_words |= codes[:, i::per_word] << np.uint32(i * bits)
  groups = cols // group
  scales = (rng.random((rows, groups)) * 0.02 + 0.001).astype(np.float32)
  biases = (rng.standard_normal((rows, groups)) * 0.05).astype(np.float32)
  if scale_dtype == "bfloat16":
    scales, biases = [(a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32) for a in (scales, biases)]
  elif scale_dtype == "float16":
    scales, biases = scales.astype(np.float16), biases.astype(np.float16)
  return QuantizedWeight(packed_words, scales, biases, group, bits)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_gguf_blocks_read_as_affine_groups_dequantise_exactly_as_gguf_does(type_name):
  raw, reference = gguf_matrix(type_name)
  w = from_gguf_blocks(raw, type_name, 96)
  assert w.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8)
  np.testing.assert_array_equal(w.dequantize(), reference)
  assert PackedMatrix.supports(w)
  matrix = PackedMatrix.from_quantized(w)
  np.testing.assert_allclose(matrix.dequantize(), reference, rtol=0, atol=1e-6 * np.abs(reference).max())
  assert matrix.nbytes == pytest.approx(raw.nbytes * HELD_PER_FILE_BYTE[type_name])
  assert matrix.nbytes < reference.nbytes / 2.6


def check_products(matrix: PackedMatrix, reference: np.ndarray) -> None:
  out_features, n_in = reference.shape
  rng = np.random.default_rng(2)
  a, b = 8, out_features - 8  # a slice, as the cores take them
  for rows in (1, 2, 7, packed.DIRECT_ROWS, packed.DIRECT_ROWS + 1, 37, packed.TRANSPOSED_ROWS + 1):  # 7: blocks of 4, 2 and 1
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    want = x.astype(np.float64) @ reference[a:b].T.astype(np.float64)
    got = matrix.product(x, a, b)
    assert got.shape == (rows, b - a) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    if rows <= packed.DIRECT_ROWS and matrix._kernel is not None:  # the direct kernel on one core and on OpenMP's threads
      outs = [np.empty((rows, b - a), dtype=np.float32) for _ in range(2)]
      for shared, out in zip((False, True), outs):
        matrix.direct(x, a, b, out, shared=shared)
      np.testing.assert_array_equal(outs[1], outs[0])  # each weight row's sums in the same order either way
  ids = np.array([0, out_features - 1, 5, 5])
  # exact for 16-bit scales (code * scale is exact); float32 ones may round once less (a fused multiply-add)
  np.testing.assert_allclose(matrix.rows(ids), reference[ids], rtol=0, atol=1e-6 * np.abs(reference).max())


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_products_from_gguf_blocks_equal_the_dequantised_products(type_name):
  raw, reference = gguf_matrix(type_name)
  check_products(PackedMatrix.from_quantized(from_gguf_blocks(raw, type_name, 96)), reference)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16", "float32"])
def test_products_from_mlx_affine_matrices_equal_the_dequantised_products(bits, group, scale_dtype):
  w = mlx_matrix(bits, group, scale_dtype)
  matrix = PackedMatrix.from_quantized(w)
  assert matrix.table_name == scale_dtype  # scales kept at their own width, exactly
  check_products(matrix, w.dequantize())


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_products_over_several_tiles_equal_the_dequantised_products(type_name, monkeypatch):
  """Tiles of 32 weight rows: the 80-row slices check_products takes span three, the last one partial (every row
  count above the direct kernel's: no panels)."""
  monkeypatch.setattr(packed, "TILE_BYTES", 32 * 4 * 256)
  monkeypatch.setattr(packed, "PANEL_ROWS", 0)
  raw, reference = gguf_matrix(type_name)
  check_products(PackedMatrix.from_quantized(from_gguf_blocks(raw, type_name, 96)), reference)


def test_rows_moved_whole_keep_their_scales():
  """The llama.cpp Q/K rows and the engine's gate/up interleave permute rows of a packed matrix."""
  raw, reference = gguf_matrix("Q4_1", rows=128)
  w = from_gguf_blocks(raw, "Q4_1", 128)
  np.testing.assert_array_equal(_unpermute_rope(w, 4).dequantize(), _unpermute_rope(reference, 4))
  order = interleaved_pairs(128)
  matrix = weight_matrix(w, order)
  x = np.random.default_rng(3).standard_normal((1, 256)).astype(np.float32)
  want = x @ reference[order].T
  np.testing.assert_allclose(product(x, matrix, 0, 128), want, rtol=0, atol=1e-5 * np.abs(want).max())
  floats = weight_matrix(reference, order)  # the float path: (in, out), the same outputs
  np.testing.assert_allclose(product(x, floats, 0, 128), want, rtol=0, atol=1e-5 * np.abs(want).max())
  np.testing.assert_array_equal(weight_rows(matrix, np.array([3])), weight_rows(floats, np.array([3])))


def test_formats_the_kernels_do_not_run_are_dequantised():
  """(mxfp4 runs packed, as exact 8-bit codes: tests/test_quantized_experts_units.py.)"""
  w = mlx_matrix(4, 32, "float16")
  codes = np.random.default_rng(5).integers(0, 0x7e, size=(80, 256), dtype=np.uint8)  # E4M3 codes short of NaN
  for other in (QuantizedWeight(codes.view(np.uint32), np.full((80, 8), 120, dtype=np.uint8), None, 32, 8, "mxfp8"),
                QuantizedWeight(np.zeros((80, 256 * 3 // 32), dtype=np.uint32), w.scales, w.biases, 32, 3)):
    matrix = weight_matrix(other)
    assert isinstance(matrix, np.ndarray) and matrix.shape == (256, 80)
    np.testing.assert_array_equal(matrix, other.dequantize().T)


@pytest.mark.parametrize("rows", [1, packed.DIRECT_ROWS + 1, packed.TRANSPOSED_ROWS + 1])
def test_a_product_writes_into_a_given_slice(rows):
  raw, reference = gguf_matrix("Q8_0")
  matrix = PackedMatrix.from_quantized(from_gguf_blocks(raw, "Q8_0", 96))
  x = np.random.default_rng(4).standard_normal((rows, 256)).astype(np.float32)
  logits = np.zeros((rows, 96), dtype=np.float32)
  product(x, matrix, 32, 64, out=logits[:, 32:64])
  want = x @ reference[32:64].T
  np.testing.assert_allclose(logits[:, 32:64], want, rtol=0, atol=1e-5 * np.abs(want).max())
  assert not logits[:, :32].any() and not logits[:, 64:].any()


class FakeSteps:
  """Steps that take `cost[shared]` fake seconds, on a fake clock, recording which way each ran."""

  def __init__(self, serial: float, shared: float):
    self.now, self.cost, self.ways = 0.0, {False: serial, True: shared}, []
    self.decode = packed.SharedDecode(clock=lambda: self.now)

  def run(self, steps: int, rows: int = 1, most: int = packed.DIRECT_ROWS) -> list:
    ways = []
    for _ in range(steps):
      with self.decode.step(rows, most):
        ways.append(kernels.step_is_shared())
        self.now += self.cost[ways[-1]]
    return ways


def test_decode_steps_share_their_products_the_faster_way_and_try_the_other_now_and_then(monkeypatch):
  monkeypatch.setitem(packed._parallel, "usable", True)
  steps = FakeSteps(serial=0.017, shared=0.013)  # not much slower: tried every TRY_EVERY steps
  every = packed.SharedDecode.TRY_EVERY
  ways = steps.run(4 + 3 * every)
  assert ways[:4] == [False, False, True, True]  # each way's first step untimed, then timed
  assert [i for i, shared in enumerate(ways) if not shared][2:] == [3 + every, 3 + 2 * every, 3 + 3 * every]  # serial: tries
  assert not kernels.step_is_shared()  # only inside a step

  steps.cost[True] = 0.200  # another process took the other core: the shared threads wait for it
  assert steps.run(every).count(True) <= 2  # the step that found it out, and perhaps a try
  tries = [i for i, shared in enumerate(steps.run(16 * every)) if shared]
  gaps = [b - a for a, b in zip(tries, tries[1:])]
  assert len(gaps) >= 2 and all(b == 2 * a for a, b in zip(gaps, gaps[1:]))  # twice as seldom each time it is still much slower

  steps.cost[True] = 0.013  # the core is free again
  ways = steps.run(packed.SharedDecode.TRY_AT_MOST_EVERY + 4)
  assert ways[-3:] == [True] * 3


def test_a_step_of_many_rows_a_slice_of_the_cores_work_or_a_process_without_openmp_threads_never_shares(monkeypatch):
  monkeypatch.setitem(packed._parallel, "usable", True)
  steps = FakeSteps(serial=0.020, shared=0.001)
  assert steps.run(8, rows=packed.DIRECT_ROWS + 1) == [False] * 8 and not steps.decode.times
  # up to `most` rows (a step of decode rows the fused pass takes whole), timed both ways and shared, the faster
  assert steps.run(8, rows=packed.DIRECT_ROWS + 1, most=packed.DIRECT_ROWS + 1) == [False, False, True, True] + [True] * 4
  # Inside Workers.split (a step's columns on both cores) OpenMP's threads would be a second team on the same cores.
  seen = []
  with steps.decode.step(1):
    Workers(cores=2).split(lambda lo, hi: seen.append(packed._shares()), 2)
  assert seen == [False, False]
  monkeypatch.setitem(packed._parallel, "usable", False)
  assert steps.run(8) == [False] * 8


def test_without_a_c_compiler_products_and_lookups_run_in_numpy_and_equal_the_dequantised_ones(monkeypatch):
  """No compiled kernels (native.library() None, as where no C compiler works): every path runs numpy's widening."""
  monkeypatch.setattr(packed, "_lib", None)
  for type_name in ("Q4_1", "Q8_0"):
    raw, reference = gguf_matrix(type_name)
    matrix = PackedMatrix.from_quantized(from_gguf_blocks(raw, type_name, 96))
    assert matrix._kernel is None
    check_products(matrix, reference)
  w = mlx_matrix(4, 64, "bfloat16")
  check_products(PackedMatrix.from_quantized(w), w.dequantize())


def test_embedding_lookups_outside_the_matrix_are_refused():
  raw, _ = gguf_matrix("Q8_0")
  matrix = PackedMatrix.from_quantized(from_gguf_blocks(raw, "Q8_0", 96))
  for ids in ([96], [-1]):
    with pytest.raises(IndexError):
      matrix.rows(np.array(ids))

"""The panel kernel (kernels_c/panels.c: batched decode's products, DIRECT_ROWS < rows <= PANEL_ROWS) against the same
matrix dequantised to float32, for every format the numpy engine keeps packed (GGUF's Q4_0, Q4_1, Q8_0 and K-quants,
MLX affine at 4 and 8 bits with each group size and scale width, MXFP4), every row count from 2 to 64, shapes that
leave partial panels, partial blocks of inputs and groups that are not whole vectors, on one core and on OpenMP's
threads."""
import numpy as np
import pytest

from exo.inference.gguf_quants import BLOCK_BYTES, from_gguf_blocks
from exo.inference.numpy import packed
from exo.inference.numpy.packed import PackedMatrix
from exo.inference.quantized import group_mxfp4_blocks
from tests.test_quantized_experts_units import random_mxfp4
from tests.test_quantized_products import gguf_matrix, mlx_matrix

pytestmark = pytest.mark.unit

needs_kernels = pytest.mark.skipif(packed._lib is None, reason="no C compiler: the panel kernel is not built")


def check_panels(matrix: PackedMatrix, reference: np.ndarray, rows_list=range(2, 65), seed: int = 0) -> None:
  """Every row count's product over a slice that starts and ends inside a panel, against float64 on the dequantised
  matrix; one core and OpenMP's threads give the same bits (each output's sums in the same order)."""
  out_features, n_in = reference.shape
  rng = np.random.default_rng(seed)
  a, b = 3, out_features - 2
  for rows in rows_list:
    x = rng.standard_normal((rows, n_in)).astype(np.float32)
    want = x.astype(np.float64) @ reference[a:b].T.astype(np.float64)
    got = np.full((rows, b - a), np.nan, dtype=np.float32)
    matrix.panels(x, a, b, got, shared=False)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max(), err_msg=f"{rows} rows")
    shared = np.full_like(got, np.nan)
    matrix.panels(x, a, b, shared, shared=True)
    np.testing.assert_array_equal(shared, got)


@needs_kernels
@pytest.mark.parametrize("type_name", list(BLOCK_BYTES))
def test_panels_from_gguf_blocks_equal_the_dequantised_products(type_name):
  """Every row count for the embedded SmolLM2's formats (Q4_1 layers, Q8_0 head), some for the others."""
  raw, reference = gguf_matrix(type_name, rows=53, cols=2304)  # 53 outputs: partial panels; 2304 inputs: two blocks
  rows = range(2, 65) if type_name in ("Q4_1", "Q8_0") else (2, 8, 9, 16, 24, 31, 32, 33, 47, 64)
  check_panels(PackedMatrix.from_quantized(from_gguf_blocks(raw, type_name, 53)), reference, rows)


@needs_kernels
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16", "float32"])
def test_panels_from_mlx_affine_matrices_equal_the_dequantised_products(bits, group, scale_dtype):
  w = mlx_matrix(bits, group, scale_dtype, rows=29, cols=2176)  # 2176 inputs: a block of 2048 and a partial one
  check_panels(PackedMatrix.from_quantized(w), w.dequantize(), rows_list=(2, 9, 16, 17, 31, 40, 64))


@needs_kernels
@pytest.mark.parametrize("bits, group, cols", [(4, 8, 72), (8, 24, 96), (4, 16, 48), (8, 2560, 5120)])
def test_panels_over_groups_that_are_not_whole_vectors_or_span_blocks(bits, group, cols):
  """4-bit groups of 8 and 16 inputs, 8-bit ones of 24 (4, 8 and 24 bytes, not whole 16-byte vectors: the plain
  loops), and 8-bit groups of 2560, larger than a block of inputs."""
  w = mlx_matrix(bits, group, "float16", rows=19, cols=cols)
  matrix = PackedMatrix.from_quantized(w)
  check_panels(matrix, w.dequantize(), rows_list=(2, 11, 33))


@needs_kernels
def test_panels_from_mxfp4_equal_the_values_it_holds():
  blocks, scales, values = random_mxfp4(np.random.default_rng(1), 1, 21, 288)
  w = group_mxfp4_blocks({"e_blocks": blocks, "e_scales": scales})["e.weight"][0]
  check_panels(PackedMatrix.from_quantized(w), values[0], rows_list=(2, 12, 25, 64))


@needs_kernels
def test_product_takes_the_panels_between_the_direct_kernel_and_the_tiles(monkeypatch):
  """product() runs the panel kernel for DIRECT_ROWS < rows <= PANEL_ROWS, writing into a slice of a larger output,
  and x that is not float32 or contiguous is converted first."""
  raw, reference = gguf_matrix("Q4_1", rows=64, cols=256)
  matrix = PackedMatrix.from_quantized(from_gguf_blocks(raw, "Q4_1", 64))
  taken = []
  panels = PackedMatrix.panels
  monkeypatch.setattr(PackedMatrix, "panels", lambda self, *args, **kw: taken.append(len(args[0])) or panels(self, *args, **kw))
  rng = np.random.default_rng(2)
  for rows in (packed.DIRECT_ROWS, packed.DIRECT_ROWS + 1, packed.PANEL_ROWS, packed.PANEL_ROWS + 1):
    x = rng.standard_normal((rows, 512))[:, ::2]  # float64, every other column
    logits = np.zeros((rows, 64), dtype=np.float32)
    matrix.product(x, 16, 40, out=logits[:, 16:40])
    want = x @ reference[16:40].T
    np.testing.assert_allclose(logits[:, 16:40], want, rtol=0, atol=2e-5 * np.abs(want).max())
    assert not logits[:, :16].any() and not logits[:, 40:].any()
  assert taken == [packed.DIRECT_ROWS + 1, packed.PANEL_ROWS]


@needs_kernels
def test_bad_shapes_are_refused_by_name():
  raw, _ = gguf_matrix("Q8_0", rows=16, cols=64)
  matrix = PackedMatrix.from_quantized(from_gguf_blocks(raw, "Q8_0", 16))
  x = np.zeros((12, 64), dtype=np.float32)
  for args in ((np.zeros((12, 65), dtype=np.float32), 0, 16, np.zeros((12, 16), dtype=np.float32)),
               (x, 0, 17, np.zeros((12, 17), dtype=np.float32)), (x, 0, 16, np.zeros((11, 16), dtype=np.float32))):
    with pytest.raises(ValueError, match="a product of"):
      matrix.panels(*args)

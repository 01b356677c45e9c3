"""The MLX engine given GGUF's quantized tensors kept packed: groups its kernels take run quantized, Q6_K's groups of
16 (which they do not take) dequantised; every product equal to gguf's own dequantisation."""
import numpy as np
import pytest

import exo.inference.mlx  # noqa: F401  (first: it binds OpenBLAS, which must precede mlx.core)

mx = pytest.importorskip("mlx.core")  # CI installs it; this only spares machines without the package

from exo.inference.gguf_quants import BLOCK_BYTES, from_gguf_blocks  # noqa: E402
from exo.inference.mlx.matrix import Matrix  # noqa: E402
from tests.test_quantized_products import gguf_matrix  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("type_name", list(BLOCK_BYTES))
def test_gguf_quantized_matrices_run_in_mlx(type_name):
  raw, reference = gguf_matrix(type_name)
  matrix = Matrix(from_gguf_blocks(raw, type_name, 96), mx.float32)
  assert (matrix.scales is None) == (type_name == "Q6_K")
  x = np.random.default_rng(5).standard_normal((2, 256)).astype(np.float32)
  want = x @ reference.T
  np.testing.assert_allclose(np.array(matrix(mx.array(x))), want, rtol=0, atol=1e-5 * np.abs(want).max())

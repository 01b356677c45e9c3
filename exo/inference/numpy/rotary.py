"""RoPE for the numpy engine, compiled (numba): one call turns a step's rows of queries or keys and scales them.

numpy's form (two halves, four products, a concatenation, then the queries' scale) is nine array operations; at one
stream they cost more than the arithmetic, twice a layer. The kernel does the same float32 operations in the same
order (no fastmath, so none is fused or reordered), so the two give the same bits."""
import numpy as np

from exo.inference.numpy.jit import numba


# Any strides (the heads are a slice of a product's output), compiled or read from numba's cache on import.
@numba.njit("void(float32[:, :, :], float32[:, :, :], float32[:, :, :], float32, float32[:, :, :])", nogil=True, cache=True,
            error_model="numpy", boundscheck=False)
def _rope(x, cos, sin, scale, out):
  rows, heads, width = x.shape
  half = width // 2
  for r in range(rows):
    row_cos, row_sin = cos[r, 0], sin[r, 0]
    for h in range(heads):
      src, dst = x[r, h], out[r, h]
      for i in range(half):
        x1, x2 = src[i], src[half + i]
        dst[i] = (x1 * row_cos[i] - x2 * row_sin[i]) * scale
        dst[half + i] = (x2 * row_cos[i] + x1 * row_sin[i]) * scale


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, scale: float = 1.0, out=None) -> np.ndarray:
  """x (rows, heads, head_dim) turned by each row's cos and sin (rows, 1, head_dim // 2), times `scale`; into `out`
  (same shape) if given. Other shapes or dtypes take numpy's form."""
  if out is None:
    out = np.empty(x.shape, dtype=np.float32)
  if (x.ndim == 3 and cos.ndim == 3 and cos.shape[0] == x.shape[0] and cos.shape[1] == 1 and 2 * cos.shape[2] == x.shape[2]
          and x.dtype == cos.dtype == sin.dtype == out.dtype == np.float32 and sin.shape == cos.shape):
    _rope(x, cos, sin, np.float32(scale), out)
    return out
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  turned = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  out[...] = turned if scale == 1.0 else turned * np.float32(scale)
  return out

"""RoPE for the numpy engine, compiled (kernels_c/rope.c): one call turns a step's rows of queries or keys and scales
them.

numpy's form (two halves, four products, a concatenation, then the queries' scale) is nine array operations; at one
stream they cost more than the arithmetic, twice a layer. The kernel does the same float32 operations in the same
order (none fused into a multiply-add), so the two give the same bits."""
import numpy as np

from exo.inference.numpy import native

_lib = native.library()


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, scale: float = 1.0, out=None) -> np.ndarray:
  """x (rows, heads, head_dim) turned by each row's cos and sin (rows, 1, head_dim // 2), times `scale`; into `out`
  (same shape) if given. Other shapes or dtypes, or no compiled kernels, take numpy's form."""
  if out is None:
    out = np.empty(x.shape, dtype=np.float32)
  if (_lib is not None and x.ndim == 3 and cos.ndim == 3 and cos.shape[0] == x.shape[0] and cos.shape[1] == 1
          and 2 * cos.shape[2] == x.shape[2] and x.dtype == cos.dtype == sin.dtype == out.dtype == np.float32
          and sin.shape == cos.shape and out.shape == x.shape and x.flags.aligned and cos.flags.aligned and sin.flags.aligned and out.flags.aligned):
    _lib.rope(x, cos, sin, scale, out)
    return out
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  turned = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  out[...] = turned if scale == 1.0 else turned * np.float32(scale)
  return out

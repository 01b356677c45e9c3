"""float16 to float32 for the KV cache's reads (cache.py stores keys and values as float16).

numpy widens float16 without the CPU's conversion instructions: 2.4 ns a value on this VM, seven times what copying
float32 costs, which made a decode step at 16 streams of 512 positions twice as slow as with a float32 cache. The
compiled kernel (kernels_c/cache.c) moves the bits instead, in vector integer instructions: a float16's exponent and
mantissa shifted into a float32's, which, multiplied by 2**112, is the same number, subnormals and zeros included.
Infinities and NaNs are not kept (a cache holds neither: a key or value that large would have overflowed float16
already). Without the compiled kernels, numpy's conversion."""
import numpy as np

from exo.inference.numpy import native

_lib = native.library()


def widen(halves: np.ndarray) -> np.ndarray:
  """A 4-dimensional float16 array (any strides; its last dimension contiguous reads fastest) as float32."""
  if _lib is None or halves.ndim != 4 or halves.dtype != np.float16 or not halves.flags.aligned:
    return halves.astype(np.float32)
  out = np.empty(halves.shape, dtype=np.float32)
  _lib.widen_halves(halves, out)
  return out

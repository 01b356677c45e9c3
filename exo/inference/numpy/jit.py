"""numba for the engine's kernels, its compiler started without SciPy.

Importing numba and starting its compiler (at the first kernel compiled or read from its cache) probe for SciPy's
BLAS, which numba needs only for linear algebra inside compiled code (np.dot, np.linalg), and so import scipy.linalg:
~18 MiB resident that a node never uses, since no kernel here does linear algebra (BLAS runs from numpy, outside the
kernels). Started with SciPy hidden, numba records that it has no BLAS (only np.correlate and np.convolve look at
that, taking their plain loop); a kernel that does call np.dot still compiles, numba importing SciPy then.

Import numba from here (`from exo.inference.numpy.jit import numba`) in a module that compiles at import, so that
the first start goes through this one; a start elsewhere only costs the memory."""
import importlib
import sys

_SCIPY = ("scipy", "scipy.linalg", "scipy.linalg.cython_blas", "scipy.linalg.cython_lapack")


def _numba_started_without_scipy():
  # A None in sys.modules makes `import name` raise ImportError; only names not imported yet are hidden, and only
  # while numba imports and its compiler's registries load (at import, before the node serves anything).
  hidden = [name for name in _SCIPY if name not in sys.modules]
  for name in hidden:
    sys.modules[name] = None
  try:
    module = importlib.import_module("numba")
    from numba.core.registry import cpu_target
    cpu_target.typing_context.refresh()
    cpu_target.target_context.refresh()
    return module
  finally:
    for name in hidden:
      if sys.modules.get(name, "") is None:
        del sys.modules[name]


numba = _numba_started_without_scipy()

__all__ = ["numba"]

"""MLX engine. On Linux, mlx[cpu] links a reference BLAS that is several times slower than OpenBLAS for the
matrix-vector products of decoding; when the system has OpenBLAS (Debian: libopenblas0-pthread) we load it with
RTLD_GLOBAL before mlx.core, so mlx's BLAS symbols bind to it. EXO_MLX_OPENBLAS=0 turns this off, or names a library."""
import ctypes
import ctypes.util
import sys

from exo import settings

OPENBLAS = None  # the library we preloaded, if any


def _preload_openblas() -> None:
  global OPENBLAS
  choice = settings.env("EXO_MLX_OPENBLAS", "1")
  if sys.platform != "linux" or choice == "0" or "mlx.core" in sys.modules:
    return
  name = choice if choice != "1" else ctypes.util.find_library("openblas")
  if name:
    try:
      ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
      OPENBLAS = name
    except OSError:
      pass


_preload_openblas()

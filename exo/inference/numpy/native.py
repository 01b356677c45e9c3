"""The numpy engine's compiled kernels (kernels_c/*.c), built by the system C compiler at first use and loaded with
ctypes.

The library is built once per installation, compiler and CPU: `CC` (else the first of cc, gcc, clang on PATH) with
-O3 -march=native, and OpenMP where the compiler links it (parallel_rows shares a product's weight rows among
OpenMP's threads; without, packed.SharedDecode never shares). It is kept under $EXO_HOME/kernels (where that cannot
be written, a folder of the user's own in the system's temporary directory), named by a hash of the sources, the
compiler's identity, the flags and the CPU's model and features, so a home shared by different machines never loads a
library built for another instruction set; a build goes to a temporary file renamed into place, so two processes
building at once each load a whole library. ctypes releases the GIL for each call, so the
engine's worker threads (kernels.py) run slices of one product at once.

Where no compiler works, `library()` is None after one warning, and each caller takes its numpy form (slower)."""
import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import List, Optional

from exo import settings
from exo.helpers import exo_home

log = logging.getLogger(__name__)
SOURCES = Path(__file__).with_name("kernels_c")
FLAGS = ["-O3", "-shared", "-fPIC", "-fopenmp-simd", "-fno-math-errno"]
# tried in turn: this CPU's instruction set by -march (GCC, clang) or -mcpu (older clang on ARM), with OpenMP first
VARIANTS = [["-march=native", "-fopenmp"], ["-march=native"], ["-mcpu=native", "-fopenmp"], ["-mcpu=native"]]

p = ctypes.c_void_p
i64 = ctypes.c_int64


class Matrix(ctypes.Structure):
  """A quantized matrix as the kernels read it (quantized.c's `matrix`), handed to them by its address (a plain
  pointer converts faster than a ctypes POINTER, 0.2 us of a small product's 2)."""
  _fields_ = [("codes", p), ("scales", p), ("biases", p), ("table", p), ("n_out", i64), ("n_in", i64), ("row_bytes", i64),
              ("n_groups", i64), ("bits", ctypes.c_int32), ("kind", ctypes.c_int32), ("fp4", ctypes.c_int32)]


array = ctypes.py_object  # a numpy array itself, its fields read by the kernel (kernels_c/arrays.h)
SIGNATURES = {
  "product_arrays": (ctypes.c_int, [p, array, array, i64, i64, ctypes.c_int]),
  "panel_product_arrays": (ctypes.c_int, [p, array, array, i64, i64, ctypes.c_int]),
  "has_threads": (ctypes.c_int, []),
  "widen_tile": (None, [p, i64, i64, array]),
  "dequantize_rows": (None, [p, p, i64, p]),
  "widen_halves": (None, [array, array]),
  "rope": (None, [array, array, array, ctypes.c_float, array]),
  "attend_decode": (ctypes.c_int, [array, i64, i64, array, i64, array, i64, ctypes.c_float, array, array]),
  "decode_step": (ctypes.c_int, [p, p, p, p, p, p, i64, p, p, p, p, ctypes.c_int, ctypes.c_int]),
}


def compiler() -> Optional[List[str]]:
  """The C compiler's command: CC if set, else the first of cc, gcc, clang found."""
  if settings.env("CC"):
    return shlex.split(settings.env("CC"))
  for name in ("cc", "gcc", "clang"):
    found = shutil.which(name)
    if found:
      return [found]
  return None


def cpu_identity() -> str:
  """The CPU's model and instruction-set features (Linux: /proc/cpuinfo's first processor), else what platform says."""
  try:
    lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
    keep = ("model name", "flags", "features", "cpu implementer", "cpu part", "isa")
    return platform.machine() + "\n" + "\n".join(line for line in lines if line.split(":")[0].strip().lower() in keep)
  except OSError:
    return f"{platform.machine()} {platform.processor()} {platform.platform()}"


def library_folders() -> List[Path]:
  """Where the library is looked for and built, in turn: exo's home, then a temporary folder of the user's own (only
  while it is theirs alone: a library placed there by another user would run in exo)."""
  folders = [exo_home() / "kernels"]
  if hasattr(os, "getuid"):
    private = Path(tempfile.gettempdir()) / f"exo-kernels-{os.getuid()}"
    try:
      private.mkdir(mode=0o700, exist_ok=True)
      status = private.stat()
      if status.st_uid == os.getuid() and not status.st_mode & 0o022:
        folders.append(private)
    except OSError:
      pass
  return folders


def _library_name(cc: List[str]) -> Optional[str]:
  try:
    version = subprocess.run(cc + ["--version"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return None
  if version.returncode != 0:
    return None
  digest = hashlib.sha256()
  for source in sorted(SOURCES.glob("*.[ch]")):
    digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
  for part in (shutil.which(cc[0]) or cc[0], " ".join(cc), version.stdout, " ".join(FLAGS), repr(VARIANTS), cpu_identity()):
    digest.update(part.encode() + b"\0")
  return f"exo-kernels-{digest.hexdigest()[:24]}.so"


def _build(cc: List[str], path: Path) -> None:
  """Compile the sources into `path` with the first of VARIANTS' flags the compiler takes; RuntimeError if none,
  OSError if `path`'s folder cannot be written."""
  path.parent.mkdir(parents=True, exist_ok=True)
  sources = [str(s) for s in sorted(SOURCES.glob("*.c"))]
  errors = []
  for extra in VARIANTS:
    fd, temporary = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
      done = subprocess.run(cc + FLAGS + extra + sources + ["-o", temporary, "-lm"], capture_output=True, text=True, timeout=300)
      if done.returncode == 0:
        os.chmod(temporary, 0o755)  # (mkstemp's file is its owner's alone; a shared home's other users load it too)
        os.replace(temporary, path)  # atomic: another process loads this library or its own, never half of one
        return
      errors.append(done.stderr.strip()[-1000:])
    except (OSError, subprocess.SubprocessError) as e:
      errors.append(str(e))
    finally:
      if os.path.exists(temporary):
        os.unlink(temporary)
  raise RuntimeError("\n".join(dict.fromkeys(errors)))


def _load() -> Optional[ctypes.CDLL]:
  cc = compiler()
  name = _library_name(cc) if cc else None
  if name is None:
    log.warning("exo: no working C compiler (%s); the numpy engine's kernels run in numpy, several times slower. "
                "Install gcc or clang, or set CC.", " ".join(cc) if cc else "set CC, or install cc, gcc or clang")
    return None
  folders = library_folders()
  path = next((folder / name for folder in folders if (folder / name).exists()), None)
  unwritable = []
  for folder in folders if path is None else ():
    try:
      _build(cc, folder / name)
      path = folder / name
      break
    except OSError as e:  # this folder cannot be written: the next
      unwritable.append(f"{folder}: {e}")
    except RuntimeError as e:
      log.warning("exo: building the numpy engine's kernels with %s failed; its kernels run in numpy, several times "
                  "slower:\n%s", " ".join(cc), e)
      return None
  if path is None:
    log.warning("exo: no folder to build the numpy engine's kernels in; its kernels run in numpy, several times "
                "slower:\n%s", "\n".join(unwritable))
    return None
  # GNU OpenMP's threads spin this long for the next product before they sleep (read as the library loads; its
  # default, ~6 ms here, made a shared step 40x slower when another process held a core: the threads spun while the
  # one with work waited for a core)
  os.environ.setdefault("GOMP_SPINCOUNT", settings.BY_ENV["GOMP_SPINCOUNT"].default)
  try:
    lib = ctypes.CDLL(str(path))
  except OSError as e:
    log.warning("exo: loading the numpy engine's kernels (%s) failed; its kernels run in numpy: %s", path, e)
    return None
  offset = array_fields_offset()
  if offset is None:
    log.warning("exo: numpy's arrays are laid out as the compiled kernels do not expect; the numpy engine's kernels run in numpy")
    return None
  return prepared(lib, offset)


def prepared(lib: ctypes.CDLL, offset: int) -> ctypes.CDLL:
  """A loaded library of the kernels, told where numpy's array fields lie (array_fields_offset) and its functions'
  signatures."""
  ctypes.c_int64.in_dll(lib, "exo_array_offset").value = offset
  for name, (restype, argtypes) in SIGNATURES.items():
    function = getattr(lib, name)
    function.restype, function.argtypes = restype, argtypes
  return lib


def array_fields_offset() -> Optional[int]:
  """Where a numpy array's fields (data, dimensions, shape, strides: kernels_c/arrays.h) start in its object, found by
  looking for its data address after the object's header and checked on arrays of other shapes; None if they are not
  laid out so."""
  import numpy as np
  word = ctypes.sizeof(ctypes.c_void_p)
  probes = [np.zeros((3, 5), dtype=np.float32), np.zeros((2, 3, 4), dtype=np.uint16)[:, 1:], np.zeros(7, dtype=np.int64)]

  def laid_out(a, at: int) -> bool:
    read = lambda address: ctypes.c_void_p.from_address(address).value
    if read(at) != a.ctypes.data or ctypes.c_int.from_address(at + word).value != a.ndim:
      return False
    shape, strides = read(at + 2 * word), read(at + 3 * word)
    return (all(ctypes.c_int64.from_address(shape + 8 * i).value == n for i, n in enumerate(a.shape))
            and all(ctypes.c_int64.from_address(strides + 8 * i).value == n for i, n in enumerate(a.strides)))
  if word != 8:
    return None
  for offset in range(word, 8 * word, word):  # the object's header: reference count and type (more in some builds)
    if ctypes.c_void_p.from_address(id(probes[0]) + offset).value == probes[0].ctypes.data:
      return offset if all(laid_out(a, id(a) + offset) for a in probes) else None
  return None


_state = {}
_loading = threading.Lock()


def library() -> Optional[ctypes.CDLL]:
  """The kernels' library, built or read from the cache on the first call; None where it cannot be (warned once)."""
  if "lib" not in _state:
    with _loading:
      if "lib" not in _state:
        _state["lib"] = _load()
  return _state["lib"]

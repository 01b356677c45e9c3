"""What a numpy-engine node imports: none of the other engines' frameworks, the grammar engine only for a constrained
request, and numba's compiler started without SciPy (exo/inference/numpy/jit.py), which still compiles linear algebra
when a kernel asks for it. Each check runs
in a fresh interpreter, since this test process has imported everything the suite needs."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

NODE_MODULES = "exo.main, exo.api.chatgpt_api, exo.orchestration.node, exo.inference.numpy.engine"


def imported_after(code: str) -> dict:
  script = f"import json, sys\n{code}\nprint(json.dumps(sorted({{name.split('.')[0] for name in sys.modules}})))"
  done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr
  return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_numpy_node_imports_no_other_engines_framework_nor_scipy():
  imported = imported_after(f"import {NODE_MODULES}\nfrom exo.inference import grammar\nassert grammar.available()")
  assert "numba" in imported  # the check below means something only where the engine's kernels were set up
  assert not imported & {"mlx", "tinygrad", "torch", "transformers", "sentence_transformers", "scipy", "llguidance"}


def test_numba_started_without_scipy_still_compiles_linear_algebra():
  code = ("import numpy as np\nfrom exo.inference.numpy.jit import numba\n"
          "assert 'scipy' not in sys.modules\n"
          "dot = numba.njit(lambda a, b: np.dot(a, b))\n"
          "assert dot(np.arange(3.0), np.ones(3)) == 3.0")
  assert "scipy" in imported_after(code)  # imported then, for the kernel that needs it

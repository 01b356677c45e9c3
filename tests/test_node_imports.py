"""What a numpy-engine node imports: none of the other engines' frameworks, the grammar engine only for a constrained
request, and neither numba nor llvmlite, also once the engine's compiled kernels (exo/inference/numpy/native.py) have
run (a node serving SmolLM2: tests/test_numpy_engine.py). Each check runs in a fresh interpreter, since this test
process has imported everything the suite needs."""
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


# Each of the numpy engine's compiled kernels run once: a quantized product (direct and tiled), an embedding lookup, RoPE,
# float16 widening and decode attention.
RUN_KERNELS = """
import numpy as np
from exo.inference.numpy import native, rotary, halves, decode_attention
from exo.inference.numpy.packed import PackedMatrix
assert native.library() is not None
m = PackedMatrix(np.zeros((64, 64), np.uint8), np.zeros((64, 4), np.uint16), np.zeros((64, 4), np.uint16), "float16", 4)
m.product(np.ones((1, 128), np.float32), 0, 64); m.product(np.ones((20, 128), np.float32), 0, 64); m.rows(np.array([3]))
rotary.rope(np.ones((1, 2, 8), np.float32), np.ones((1, 1, 4), np.float32), np.ones((1, 1, 4), np.float32))
halves.widen(np.ones((1, 1, 2, 8), np.float16))
decode_attention.attend_decode(np.ones((1, 1, 2, 1, 4, 8), np.float32), 0, 0, np.ones((1, 2, 8), np.float32), 0,
                               np.array([4]), 0, 0.0, np.zeros(0, np.float32), np.empty((1, 16), np.float32))
"""


def test_a_numpy_node_imports_no_other_engines_framework_nor_scipy():
  imported = imported_after(f"import {NODE_MODULES}\nfrom exo.inference import grammar\nassert grammar.available()\n{RUN_KERNELS}")
  assert not imported & {"mlx", "tinygrad", "torch", "transformers", "sentence_transformers", "scipy", "llguidance", "numba", "llvmlite"}

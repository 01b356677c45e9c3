"""numpy, tinygrad and MLX run the same SmolLM2-135M: same greedy tokens, same logits within FLOAT16_KV_LOGIT_ATOL (numpy's
KV cache is float16, theirs float32; tests/support/engines.py)."""
import asyncio

import numpy as np
import pytest

import exo.inference.mlx  # noqa: F401  (first: it binds OpenBLAS, which must precede mlx.core)
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from tests.support import engines as common

pytestmark = pytest.mark.model

TOKENS = 32
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def engine_classes():
  classes = {"numpy": NumpyDynamicShardInferenceEngine}
  # CI installs both; importorskip only spares machines without one of them.
  pytest.importorskip("tinygrad")
  from exo.inference.tinygrad.engine import TinygradDynamicShardInferenceEngine
  classes["tinygrad"] = TinygradDynamicShardInferenceEngine
  pytest.importorskip("mlx.core")
  from exo.inference.mlx.engine import MLXDynamicShardInferenceEngine
  classes["mlx"] = MLXDynamicShardInferenceEngine
  return classes


@pytest.fixture(scope="module")
def generations(downloader):
  """Per engine: the 3 prompts decoded greedily together for TOKENS tokens (through EOS), and their prompt logits."""
  out = {}
  for name, cls in engine_classes().items():
    engine = common.load_engine(cls, downloader)
    prompts = common.prompt_ids(engine, PROMPTS)
    first = {}
    tokens = asyncio.run(common.batched(engine, prompts, TOKENS, f"agree-{name}", join_every=0, stop_at_eos=False, first_logits=first))
    assert engine.kv_cache_bytes() == 0
    out[name] = tokens, [first[i] for i in range(len(prompts))]
  return out


@pytest.mark.parametrize("name", ["tinygrad", "mlx"])
def test_greedy_tokens_agree_with_numpy(generations, name):
  tokens, _ = generations[name]
  reference, _ = generations["numpy"]
  for text, got, want in zip(PROMPTS, tokens, reference):
    assert len(got) == TOKENS and got == want, f"{name} diverges from numpy on {text!r}"


@pytest.mark.parametrize("name", ["tinygrad", "mlx"])
def test_prompt_logits_agree_with_numpy(generations, name):
  _, logits = generations[name]
  _, reference = generations["numpy"]
  for got, want in zip(logits, reference):
    assert got.shape == want.shape == (49152,)
    np.testing.assert_allclose(got, want, atol=common.FLOAT16_KV_LOGIT_ATOL, rtol=0)  # numpy's cache is float16, theirs float32

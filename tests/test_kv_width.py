"""The KV cache counted at the width each engine stores it in: the numpy engine's float32, or float16 with
EXO_KV_BITS=16 (2 bytes a value), in what a cache says it holds (/v1/state's kv_bytes), in admission's arithmetic
(ModelLimits) and in placement's reserve."""
import numpy as np
import pytest

from exo.api.model_limits import ModelLimits
from exo.inference.models import model_config
from exo.inference.numpy.cache import KVCache, KVPool
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.topology.model_size import kv_value_bytes

pytestmark = pytest.mark.unit

SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


@pytest.fixture
def float16_kv(monkeypatch):
  monkeypatch.setenv("EXO_KV_BITS", "16")


def test_the_numpy_engines_cache_is_float32_or_as_set_and_says_so(monkeypatch):
  config = model_config(SMOLLM2)
  engine = NumpyDynamicShardInferenceEngine(None)
  assert engine.kv_bytes_per_value(config) == 4 and KVPool(1, 1, 64, 1024).dtype == np.float32
  monkeypatch.setenv("EXO_KV_BITS", "16")
  assert engine.kv_bytes_per_value(config) == 2 and KVPool(1, 1, 64, 1024).dtype == np.float16
  assert kv_value_bytes(type(engine).__name__, 4) == 4  # placement's reserve: not told, it counts float32 (room to spare)
  assert kv_value_bytes("TinygradDynamicShardInferenceEngine", 4) == 4 and kv_value_bytes("MLXDynamicShardInferenceEngine", 2) == 2


def test_admission_counts_a_request_at_the_engines_width(float16_kv):
  config = model_config(SMOLLM2)
  limits = ModelLimits.of(config, NumpyDynamicShardInferenceEngine(None).kv_bytes_per_value(config))
  assert limits.kv_bytes(positions=100, layers=range(30)) == 100 * 30 * 2 * 3 * 64 * 2  # K and V, 3 heads of 64, float16
  assert ModelLimits.of(config, 4).kv_bytes(100, range(30)) == 2 * limits.kv_bytes(100, range(30))


def test_a_cache_holds_and_reports_two_bytes_a_value(float16_kv):
  pool = KVPool(n_layers=2, n_kv_heads=2, head_dim=64, positions=2048)
  cache = KVCache(pool)
  assert cache.data.dtype == np.float16 and pool.slot_bytes == 2 * 2 * 2 * 2048 * 64 * 2
  cache.length = 1024
  assert cache.nbytes == 2 * 2 * 2 * 1024 * 64 * 2  # whole pages: 1,024 positions of 64 float16 values per row
  cache.data[0, 0, 0, :3] = np.float32(1 / 3)
  assert (cache.data[0, 0, 0, 0] == np.float16(1 / 3)).all()

from typing import Optional, Tuple

import numpy as np

from exo.inference.inference_engine import InferenceEngine
from exo.inference.shard import Shard
from exo.inference.tokenizers import DummyTokenizer


class DummyInferenceEngine(InferenceEngine):
  """Upstream's CI engine: every ring pass adds 1 on the last layer; "tokens" 2..10 then EOS 69."""

  def __init__(self):
    self.shard = None
    self.vocab_size = 1000
    self.hidden_size = 256
    self.eos_token_id = 0
    self.num_generate_dummy_tokens = 10
    self.tokenizer = DummyTokenizer()

  async def encode(self, shard: Shard, prompt: str) -> np.ndarray:
    return np.array([1])

  async def sample(self, x: np.ndarray, temp: float = 0.0, top_p: float = 1.0) -> np.ndarray:
    if x[0] > 10:
      return np.array([self.tokenizer.eos_token_id])
    return x

  async def sample_batch(self, logits, params, generators) -> np.ndarray:
    return np.array([int(np.asarray(await self.sample(x)).item()) for x in logits])

  async def decode(self, shard: Shard, tokens: np.ndarray) -> str:
    return "dummy" * len(tokens)

  async def infer_tensor(self, request_id: str, shard: Shard, input_data: np.ndarray, inference_state: Optional[dict] = None) -> Tuple[np.ndarray, Optional[dict]]:
    await self.ensure_shard(shard)
    return input_data + 1 if self.shard.is_last_layer() else input_data, None

  async def ensure_shard(self, shard: Shard):
    self.shard = shard

  async def load_checkpoint(self, shard: Shard, path: str):
    await self.ensure_shard(shard)

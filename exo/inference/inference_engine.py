from abc import ABC, abstractmethod
from typing import List, Optional, Tuple

import numpy as np

from exo.inference.sampling import SamplingParams, last_rows, sample_rows
from exo.inference.shard import Shard


class InferenceEngine(ABC):
  """Runs a shard's layers for requests, each with its own KV cache keyed by request_id."""

  @abstractmethod
  async def encode(self, shard: Shard, prompt: str) -> np.ndarray:
    ...

  @abstractmethod
  async def sample(self, x: np.ndarray) -> np.ndarray:
    ...

  @abstractmethod
  async def decode(self, shard: Shard, tokens: np.ndarray) -> str:
    ...

  @abstractmethod
  async def infer_tensor(self, request_id: str, shard: Shard, input_data: np.ndarray, inference_state: Optional[dict] = None) -> Tuple[np.ndarray, Optional[dict]]:
    ...

  @abstractmethod
  async def load_checkpoint(self, shard: Shard, path: str):
    ...

  async def infer_prompt(self, request_id: str, shard: Shard, prompt: str, inference_state: Optional[dict] = None) -> Tuple[np.ndarray, Optional[dict]]:
    tokens = await self.encode(shard, prompt)
    return await self.infer_tensor(request_id, shard, tokens.reshape(1, -1), inference_state)

  # --- exo additions (optional; every engine works without overriding them) ---

  async def infer_batch(self, shard: Shard, items: List[Tuple[str, np.ndarray, Optional[dict]]]) -> List[Tuple[np.ndarray, Optional[dict]]]:
    """One engine step for many requests: items are (request_id, input, inference_state).
    Returns one (output, state) per item, in order; a failed item's entry is its exception.
    Batch-capable engines override this to run token-parallel work for all rows at once."""
    results = []
    for request_id, x, state in items:
      try:
        results.append(await self.infer_tensor(request_id, shard, x, state))
      except Exception as e:
        results.append(e)
    return results

  async def sample_batch(self, logits: List[np.ndarray], params: List[SamplingParams], generators: List[np.random.Generator]) -> np.ndarray:
    """Sample the last position of each request's logits, each with its own parameters and random stream."""
    return sample_rows(last_rows(logits), params, generators)

  async def finish_request(self, request_id: str) -> None:
    """Free what the engine holds for a request that has ended (its KV cache)."""


inference_engine_classes = {
  "mlx": "MLXDynamicShardInferenceEngine",
  "tinygrad": "TinygradDynamicShardInferenceEngine",
  "numpy": "NumpyDynamicShardInferenceEngine",
  "dummy": "DummyInferenceEngine",
}

"""The engine contract: what a node asks of the engine that runs its layers.

Every capability an engine may have is declared here with a default that means "not this engine", so callers use
it without probing: an engine written for upstream exo (encode, sample, decode, infer_tensor, load_checkpoint)
runs unchanged, one request at a time, and the Llama engines (llama_engine.py) override the rest."""
from abc import ABC, abstractmethod
from typing import List, Optional, Tuple

import numpy as np

from exo.inference.sampling import SamplingParams, last_rows, sample_rows
from exo.inference.shard import Shard


class InferenceEngine(ABC):
  """Runs a shard's layers for requests, each with its own KV cache keyed by request_id."""

  session = {}  # upstream's per-engine key/value store (save_session)
  shard: Optional[Shard] = None  # the loaded shard
  tokenizer = None  # the loaded model's tokenizer (encode, decode, apply_chat_template, eos_token_id)
  device_name: str = "CPU"  # what the engine computes on, as device_capabilities reports it (CPU, METAL, CUDA, ...)
  copies_prefixes: bool = False  # it can start a request from another request's cached prompt prefix

  # --- upstream's methods ---

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

  async def save_checkpoint(self, shard: Shard, path: str):
    """Write the shard's weights (training engines; inference engines have nothing to save)."""

  async def save_session(self, key, value):
    self.session = {**self.session, key: value}  # this engine's own copy, not the class's

  async def clear_session(self):
    self.session = {}

  async def infer_prompt(self, request_id: str, shard: Shard, prompt: str, inference_state: Optional[dict] = None) -> Tuple[np.ndarray, Optional[dict]]:
    tokens = await self.encode(shard, prompt)
    return await self.infer_tensor(request_id, shard, tokens.reshape(1, -1), inference_state)

  async def ensure_shard(self, shard: Shard) -> None:
    """Make `shard` the loaded one (downloading it first where needed). An engine with nothing to load records it."""
    self.shard = shard

  # --- exo's additions: every engine works without overriding them ---

  @property
  def context_length(self) -> Optional[int]:
    """Positions the loaded model was trained for; None: unknown (nothing is checked against it)."""
    return None

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
    if all(p.temperature <= 0 for p in params):  # greedy: each row's argmax, without stacking the rows (MBs a step)
      return np.array([np.argmax(np.asarray(x).reshape(-1, np.shape(x)[-1])[-1]) for x in logits], dtype=np.int64)
    return sample_rows(last_rows(logits), params, generators)

  async def finish_request(self, request_id: str) -> None:
    """Free what the engine holds for a request that has ended (its KV cache)."""

  # Whether a sliding-window layer's KV cache keeps only its window (admission and placement then count it so);
  # an engine whose cache keeps every position of every layer is counted that way.
  kv_keeps_window = False

  def kv_bytes_per_value(self, config) -> int:
    """Bytes one cached key or value element takes in this engine's KV cache for a model of `config` (admission
    counts a request's cache at this width)."""
    return 4

  def kv_cache_bytes(self) -> int:
    """KV memory the live requests hold (0: the engine does not say)."""
    return 0

  def request_kv_bytes(self, request_id: str) -> int:
    """KV bytes one live request holds; 0 if it holds none."""
    return 0

  # --- prompt prefixes (see prefix_cache.py, whose PrefixReuse implements them) ---

  prefix_starts_queued = 0  # start_from_prefix calls waiting for the engine (behind a step): requests about to arrive

  @property
  def reuses_prefixes(self) -> bool:
    """Whether the engine starts requests from cached prompt prefixes now (it copies them and its cache is on)."""
    return False

  def set_prefix_budget(self, budget_bytes: int) -> None:
    """KV memory the prefix cache may keep for ended requests; 0 turns it off."""

  async def start_from_prefix(self, request_id: str, shard: Shard, keys: List[str], limit: int) -> int:
    """Begin the request's KV cache with the longest cached prefix of `keys` (at most `limit` positions); returns the
    positions it starts with. Called only while `reuses_prefixes`."""
    return 0

  def remember_prefix(self, request_id: str, keys: List[str]) -> None:
    """File the request's cache under its prompt's block keys, once its prompt has run here."""

  def extend_prefix(self, request_id: str, keys: List[str]) -> None:
    """The request has finished: file its cache under the keys of its prompt's and its answer's blocks."""

  def prefix_cache_bytes(self) -> int:
    """KV memory the prefix cache alone keeps (of requests that have ended)."""
    return 0

  def prefix_cache_state(self) -> dict:
    """The prefix cache as GET /v1/state shows it."""
    return {"enabled": False}


inference_engine_classes = {
  "mlx": "MLXDynamicShardInferenceEngine",
  "tinygrad": "TinygradDynamicShardInferenceEngine",
  "numpy": "NumpyDynamicShardInferenceEngine",
  "dummy": "DummyInferenceEngine",
}


def get_inference_engine(inference_engine_name: str, shard_downloader) -> InferenceEngine:
  """The engine `--inference-engine` names (upstream's import path; exo/inference/engines.py builds it)."""
  from exo.inference.engines import get_inference_engine as build
  return build(inference_engine_name, shard_downloader)

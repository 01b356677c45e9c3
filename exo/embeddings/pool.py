"""The embedding models a node holds beside its chat models: each loaded on first use (concurrent first requests share
the load), kept while requests use it, and unloaded once it has been idle for its keep-alive (exo/keep_alive.py)."""
import asyncio
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Dict, List, Optional

from exo.embeddings.model import EmbeddingModel
from exo.keep_alive import DEFAULT_KEEP_ALIVE_S, KeepAlive, KeptPool

__all__ = ["DEFAULT_KEEP_ALIVE_S", "EmbeddingPool"]


class EmbeddingPool(KeptPool):
  def __init__(self, load: Callable[[str], EmbeddingModel], keep_alive: float = DEFAULT_KEEP_ALIVE_S, clock: Callable[[], float] = time.monotonic):
    self.load = load
    self.models: Dict[str, EmbeddingModel] = {}
    self.residents = KeepAlive(lambda model_id: self.models.pop(model_id, None), keep_alive, clock)
    self.loading: Dict[str, asyncio.Future] = {}
    self.loads = 0  # models loaded so far: how tests and logs see that nothing was loaded twice

  @asynccontextmanager
  async def use(self, model_id: str, keep_alive: Optional[float] = None) -> AsyncIterator[EmbeddingModel]:
    """The model, held (never unloaded) until the block ends; then kept for `keep_alive` (the node's when None)."""
    self.sweep()
    model = self.models.get(model_id) or await self._load(model_id)
    self.residents.take(model_id)
    try:
      yield model
    finally:
      self.residents.release(model_id, keep_alive)

  async def _load(self, model_id: str) -> EmbeddingModel:
    loading = self.loading.get(model_id)
    if loading is None:
      loading = self.loading[model_id] = asyncio.ensure_future(asyncio.to_thread(self.load, model_id))
      loading.add_done_callback(lambda _: self.loading.pop(model_id, None))  # a failed load is tried again by the next request
    model = await asyncio.shield(loading)
    if model_id not in self.models:  # the first of the requests that waited for it
      self.models[model_id] = model
      self.residents.add(model_id)
      self.loads += 1
    return self.models[model_id]

  def sweep(self) -> List[str]:
    """Unloads every idle model whose keep-alive has run out; the ids unloaded."""
    return self.residents.sweep()

  def close(self) -> None:
    self.residents.close()
    self.models.clear()

  def describe(self) -> List[dict]:
    """What is loaded, for /api/ps and /v1/state: seconds loaded, seconds until unloaded (None: never, or in use).
    What has expired by `clock()` is unloaded first."""
    self.sweep()
    now = self.clock()
    return [{"model": model_id, "dimensions": self.models[model_id].dimensions, "max_tokens": self.models[model_id].max_tokens,
             "requests": resident.in_use, **resident.times(now)} for model_id, resident in self.residents.residents.items()]

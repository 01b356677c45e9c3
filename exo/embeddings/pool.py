"""The embedding models a node holds beside its chat model: each loaded on first use (concurrent first requests share
the load), kept while requests use it, and unloaded once it has been idle for its keep-alive (Ollama's: five minutes
unless the node or a request says otherwise; 0 unloads it as soon as its requests end; forever is math.inf).

Time is `clock()` (monotonic seconds; tests pass a fake one); `sweep()` unloads what has expired, and a task on the
event loop calls it when the next keep-alive runs out."""
import asyncio
import math
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Dict, List, Optional

from exo.embeddings.model import EmbeddingModel

DEFAULT_KEEP_ALIVE_S = 300.0  # as Ollama's


@dataclass
class Held:
  model: EmbeddingModel
  loaded_at: float
  last_used: float
  keep_alive: float
  in_use: int = 0

  @property
  def expires_at(self) -> float:
    """When it is unloaded if nothing uses it meanwhile (inf: never; while requests use it, their last end plus keep-alive)."""
    return self.last_used + self.keep_alive


class EmbeddingPool:
  def __init__(self, load: Callable[[str], EmbeddingModel], keep_alive: float = DEFAULT_KEEP_ALIVE_S, clock: Callable[[], float] = time.monotonic):
    self.load, self.keep_alive, self.clock = load, keep_alive, clock
    self.held: Dict[str, Held] = {}
    self.loading: Dict[str, asyncio.Future] = {}
    self.loads = 0  # models loaded so far: how tests and logs see that nothing was loaded twice
    self.timer: Optional[asyncio.TimerHandle] = None

  @asynccontextmanager
  async def use(self, model_id: str, keep_alive: Optional[float] = None) -> AsyncIterator[EmbeddingModel]:
    """The model, held (never unloaded) until the block ends; then kept for `keep_alive` (the node's when None: as
    Ollama's, each request sets how long the model stays after it)."""
    self.sweep()
    held = self.held.get(model_id) or await self._load(model_id)
    held.in_use += 1
    try:
      yield held.model
    finally:
      held.in_use -= 1
      held.last_used = self.clock()
      held.keep_alive = self.keep_alive if keep_alive is None else keep_alive
      self.sweep()

  async def _load(self, model_id: str) -> Held:
    loading = self.loading.get(model_id)
    if loading is None:
      loading = self.loading[model_id] = asyncio.ensure_future(asyncio.to_thread(self.load, model_id))
      loading.add_done_callback(lambda _: self.loading.pop(model_id, None))  # a failed load is tried again by the next request
    model = await asyncio.shield(loading)
    if model_id not in self.held:  # the first of the requests that waited for it
      now = self.clock()
      self.held[model_id] = Held(model, now, now, self.keep_alive)
      self.loads += 1
    return self.held[model_id]

  def sweep(self) -> List[str]:
    """Unloads every idle model whose keep-alive has run out; the ids unloaded. Then sets the timer for the next."""
    now = self.clock()
    gone = [model_id for model_id, held in self.held.items() if held.in_use == 0 and held.expires_at <= now]
    for model_id in gone:
      del self.held[model_id]
    self._set_timer(now)
    return gone

  def _set_timer(self, now: float) -> None:
    if self.timer is not None:
      self.timer.cancel()
      self.timer = None
    due = min((held.expires_at for held in self.held.values() if held.in_use == 0), default=math.inf)
    if math.isfinite(due):
      try:
        self.timer = asyncio.get_running_loop().call_later(max(0.0, due - now) + 0.01, self.sweep)
      except RuntimeError:  # no loop (a test sweeping by hand): the next use sweeps
        pass

  def close(self) -> None:
    if self.timer is not None:
      self.timer.cancel()
    self.held.clear()

  def describe(self) -> List[dict]:
    """What is loaded, for /api/ps and /v1/state: seconds loaded, seconds until unloaded (None: never, or in use).
    What has expired by `clock()` is unloaded first."""
    self.sweep()
    now = self.clock()
    return [{"model": model_id, "dimensions": held.model.dimensions, "max_tokens": held.model.max_tokens, "requests": held.in_use,
             "loaded_s": now - held.loaded_at, "expires_in_s": None if held.in_use or not math.isfinite(held.expires_at) else max(0.0, held.expires_at - now)}
            for model_id, held in self.held.items()]

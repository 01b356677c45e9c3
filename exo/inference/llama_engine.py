"""What every Llama engine does the same way: load a shard, keep one KV cache per request, check inputs, run a
batched step on the engine's own worker thread, keep prompt prefixes for later requests (prefix_cache.PrefixReuse).
An engine subclass names its model class and its thread."""
import asyncio
import ctypes
import ctypes.util
import functools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import numpy as np

from exo.inference.chained_steps import Chained, Ticket, greedy_tokens
from exo.inference.gguf_header import is_gguf
from exo.inference.inference_engine import InferenceEngine
from exo.inference.prefix_cache import PrefixReuse
from exo.inference.sampling import sample_last
from exo.inference.shard import Shard
from exo.inference.tokenizers import resolve_tokenizer
from exo.inference.weights import LlamaConfig, gguf_reader, load_config, load_shard_weights


log = logging.getLogger(__name__)

HANDOFF_WAIT_S = 0.002  # the most the event loop waits for the engine's thread to start a call (see _run)


class EngineBusy(RuntimeError):
  """The engine cannot load another shard while requests hold KV caches of the loaded one."""


class LlamaShardEngine(PrefixReuse, InferenceEngine):
  """All model work runs on `executor` (one thread), in order, so the event loop stays free.

  The model class (exo/inference/<backend>/llama.py) takes (config, shard, weights) and provides `config`,
  new_cache() and forward(inputs, caches): inputs are token ids (L,) on the first shard or hidden states (L, d);
  outputs are hidden states, or on the last shard the logits of each request's last position (1, vocab). A cache
  (exo/inference/<backend>/cache.py) has `length`, `nbytes` and copy_prefix(source, positions)."""

  keeps_quantized = False  # True: the model class takes quantized matrices (MLX, GGUF) as QuantizedWeight, not float32
  quantize_bits: Optional[int] = None  # 4 or 8: float checkpoints are quantized as they load (only where keeps_quantized)

  def __init__(self, shard_downloader, executor: ThreadPoolExecutor):
    self.shard_downloader = shard_downloader
    self.executor = executor
    self.shard: Optional[Shard] = None
    self.model = None
    self.tokenizer = None
    self.caches: Dict[str, object] = {}
    self.prefixes = self.new_prefix_store()
    self._load_lock = asyncio.Lock()
    self._queued = 0  # calls handed to the thread and not yet finished
    self._chaining = 0  # steps the thread chained itself and has not finished (only the thread changes it)

  def new_model(self, config: LlamaConfig, shard: Shard, weights: Dict[str, np.ndarray]):
    raise NotImplementedError

  async def _run(self, fn, *args):
    return await self._start(fn, *args)

  def _start(self, fn, *args) -> asyncio.Future:
    """`fn(*args)` handed to the engine's thread, started (or queued behind the calls before it) when this returns."""
    if self._queued or self._chaining:  # it runs after them: the thread is not waiting for the GIL to start it
      return self._queue(fn, *args)
    started = threading.Event()
    future = self._queue(_started, started, fn, *args)
    # The thread is woken now but must take the GIL before it starts, and this thread holds it while the event loop runs
    # the callbacks due (a step's tokens on their way to their streams): it waited ~0.4 ms of every one-row step.
    # Waiting here lets it go; the callbacks then run while the step runs (its products release the GIL).
    started.wait(HANDOFF_WAIT_S)
    return future

  def _queue(self, fn, *args) -> asyncio.Future:
    self._queued += 1
    future = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
    future.add_done_callback(self._ran)
    return future

  def _ran(self, _) -> None:
    self._queued -= 1

  def _load(self, path, shard: Shard) -> None:
    """On the engine's thread, so it runs after every step queued before it and before every step queued after.
    It refuses while requests hold KV caches of the loaded shard: switching would silently wipe them."""
    if self.caches:
      raise EngineBusy(f"{len(self.caches)} request(s) still hold KV caches of {self.shard.model_id} "
                       f"(layers {self.shard.start_layer}-{self.shard.end_layer}); {shard.model_id} can load once they end")
    self.shard = self.model = self.tokenizer = None  # the old weights go before the new ones arrive
    self.prefixes.clear()
    reader = gguf_reader(path) if is_gguf(path) else None  # held while the weights, the tokenizer and the config read it: one parse
    config, weights = load_shard_weights(path, shard, keep_quantized=self.keeps_quantized, quantize=self.quantize_bits if self.keeps_quantized else None)
    model, tokenizer = self.new_model(config, shard, weights), resolve_tokenizer(path)
    load_config(path)  # cached: the API reads the model's config next, which would otherwise parse the file again
    del weights, reader  # the parsed GGUF metadata goes with its last holder: tens of MB of small arrays
    _return_freed_memory()
    self.model, self.tokenizer, self.shard = model, tokenizer, shard

  def unload(self) -> None:
    """Let the model's weights go (the node's model pool unloads an idle model); the next ensure_shard loads again.
    On the engine's thread, after the work queued before it."""
    self.shard = None
    self.executor.submit(self._unload)

  def _unload(self) -> None:
    if self.shard is None:  # (a load queued meanwhile keeps its model)
      self.model = self.tokenizer = None
      self.prefixes.clear()
      _return_freed_memory()

  async def ensure_shard(self, shard: Shard) -> None:
    if self.shard == shard:
      return
    async with self._load_lock:
      if self.shard == shard:
        return
      path = await self.shard_downloader.ensure_shard(shard, self.__class__.__name__)
      await self._run(self._load, path, shard)

  @property
  def context_length(self) -> Optional[int]:
    """Positions the loaded model was trained for (None before a load)."""
    model = self.model
    return None if model is None else model.config.max_position_embeddings

  async def encode(self, shard: Shard, prompt: str) -> np.ndarray:
    await self.ensure_shard(shard)
    # A long prompt takes a while to tokenise: not on the event loop, and not on the engine's thread behind its steps.
    return np.array(await asyncio.to_thread(self.tokenizer.encode, prompt), dtype=np.int64)

  async def decode(self, shard: Shard, tokens: np.ndarray) -> str:
    await self.ensure_shard(shard)
    return self.tokenizer.decode(tokens)

  async def sample(self, x: np.ndarray, temp: float = 0.0, top_p: float = 1.0) -> np.ndarray:
    return sample_last(x, temp, top_p)

  async def infer_tensor(self, request_id: str, shard: Shard, input_data: np.ndarray, inference_state: Optional[dict] = None) -> Tuple[np.ndarray, Optional[dict]]:
    result = (await self.infer_batch(shard, [(request_id, input_data, inference_state)]))[0]
    if isinstance(result, Exception):
      raise result
    return result

  async def infer_batch(self, shard: Shard, items: List[Tuple[str, np.ndarray, Optional[dict]]]) -> List[Tuple[np.ndarray, Optional[dict]]]:
    await self.ensure_shard(shard)
    return await self._run(self._step, shard, items)

  def start_ahead(self, shard: Shard, items: List[Tuple[str, np.ndarray, Optional[dict]]], ticket: Optional[Ticket] = None) -> Optional[asyncio.Future]:
    """A step of requests that hold a KV cache here, started now, before their callers have asked for it (the step
    loop's run-ahead, steps/ahead.py): None unless `shard` is loaded. A request whose cache is gone by the time the
    step runs (it ended) gets an error and no new cache. `ticket`: what the loop grants to follow the step
    (chained_steps.py)."""
    if self.shard != shard:
      return None
    return self._start(self._step, shard, items, True, ticket)

  def _chain(self, shard: Shard, items, results, ticket: Ticket) -> None:
    """As a step with a ticket ends, on the engine's thread: the next step of the requests granted, queued now."""
    follow = ticket.end()
    if not follow:
      return
    try:
      rows = greedy_tokens(items, results, follow)
      if rows:
        following = Ticket()
        future = self.executor.submit(self._chained_step, shard, rows, following)
        self._chaining += 1
        ticket.chained = Chained(rows, future, following)
    except Exception as e:  # (an executor shutting down): the step's own results stand, the loop steps on as without a grant
      log.debug("no step chained after a step of %d rows: %r", len(items), e)

  def _chained_step(self, shard: Shard, rows, ticket: Ticket):
    try:
      return self._step(shard, rows, True, ticket)
    finally:
      self._chaining -= 1

  def _step(self, shard: Shard, items, continuing: bool = False, ticket: Optional[Ticket] = None):
    """One forward for every valid item; an invalid one gets its own error and touches no cache (`continuing`: nor
    does one without a cache, which it would otherwise begin)."""
    if self.shard != shard:  # a load ran in between (see _load)
      return [RuntimeError(f"the engine now holds {self.shard}, not {shard}")] * len(items)
    results: List = [None] * len(items)
    inputs, caches, rows, seen = [], [], [], set()
    for i, (request_id, x, state) in enumerate(items):
      try:
        if request_id in seen:  # one cache cannot take two chunks in one step
          raise ValueError(f"request {request_id} appears twice in one batch")
        if continuing and request_id not in self.caches:
          raise ValueError(f"request {request_id} holds no KV cache here (it has ended)")
        x = self._check_input(np.asarray(x))
        held = self.caches[request_id].length if request_id in self.caches else 0
        if held + len(x) > self.model.config.max_position_embeddings:
          raise ValueError(f"{held + len(x)} positions exceed the model's context of {self.model.config.max_position_embeddings}")
        inputs.append(x)
      except ValueError as e:
        results[i] = e
        continue
      seen.add(request_id)
      if request_id not in self.caches:
        self.caches[request_id] = self.model.new_cache()
      caches.append(self.caches[request_id])
      rows.append(i)
    if rows:
      for i, out in zip(rows, self.model.forward(inputs, caches)):
        results[i] = (out[None], items[i][2])
    if ticket is not None:
      self._chain(shard, items, results, ticket)
    return results

  def _check_input(self, x: np.ndarray) -> np.ndarray:
    """One request's input as the model takes it; a clear error instead of a broken cache."""
    c = self.model.config
    if self.shard.is_first_layer():
      if not np.issubdtype(x.dtype, np.integer) or x.size == 0:
        raise ValueError(f"first shard expects token ids, got {x.dtype} {x.shape}")
      ids = x.reshape(-1)
      if ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(f"token id out of range [0, {c.vocab_size})")
      return ids
    if x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != c.hidden_size or x.shape[1] == 0:
      raise ValueError(f"expected hidden states (1, L, {c.hidden_size}), got {x.shape}")
    return x[0].astype(np.float32, copy=False)

  async def finish_request(self, request_id: str) -> None:
    await self._run(self._drop_cache, request_id)

  def _drop_cache(self, request_id: str) -> None:
    self.caches.pop(request_id, None)  # not returned: a future holding it would keep its memory until collected
    self.prefixes.trim()
    if not self.caches:  # the last live request has ended: what its steps allocated goes back too
      _return_freed_memory()

  def kv_cache_bytes(self) -> int:
    return sum(cache.nbytes for cache in list(self.caches.values()))

  def request_kv_bytes(self, request_id: str) -> int:
    cache = self.caches.get(request_id)
    return 0 if cache is None else cache.nbytes

  async def load_checkpoint(self, shard: Shard, path: str):
    await self.ensure_shard(shard)


def _started(started: threading.Event, fn, *args):
  started.set()
  return fn(*args)


@functools.lru_cache(maxsize=None)
def _malloc_trim():
  libc = ctypes.util.find_library("c")  # runs ldconfig: once
  return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None


def _return_freed_memory() -> None:
  """Hand the heap's free pages back to the kernel (glibc). Loading frees gigabytes of temporaries a few MB at a
  time, and a busy step's threads free their activations the same way; glibc's allocator, having raised its mmap
  threshold past those sizes, keeps them in its arenas otherwise."""
  trim = _malloc_trim()
  if trim is not None:
    trim(0)

"""Prompt prefixes whose KV this node has computed, so that a new prompt that starts the same way skips them.

A prompt is cut into blocks of BLOCK tokens and each block named by a hash chain: a block's key hashes the key before
it and its own tokens, so one key names the whole prefix up to the end of its block (as vLLM's automatic prefix
caching names its blocks). Only the node with the first layers sees tokens; it sends the keys on with the request
(see Node), and every node files the request's KV cache under them once its prompt has run there. When the request
finishes, its first node names the blocks its answer added, and every node extends the request's entry with them:
the next turn of a chat, whose prompt holds that answer, reuses it too.

The store holds references to KV caches, never copies: a prefix is read from the cache that computed it, which only
ever appends past its prompt. A cache still used by a live request costs the store nothing and is never evicted;
caches only the store holds count against its budget and go least recently used first. A new request may take over
a cache no live request uses (no copy at all): the entry then keeps only the blocks the two share, since the new
request writes past them.

A model with sliding-window layers is the exception to "only ever appends": a cache may hand back the pages of a
sliding layer's positions its next query no longer sees (the numpy engine's does, exo/inference/numpy/cache.py). A
prefix is then reused only while its cache still holds the window that prefix's next query sees (`starts_from`):
the next turn of a chat, whose prefix ends where the last answer did, always is; a prompt another request has since
decoded a window past is not, and is computed again.

PrefixReuse, at the end, is the engine's side: the prefix methods of the engine contract for an engine that keeps one
KV cache per request."""
import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np

BLOCK = 8  # tokens per block: a hit reuses whole blocks, so the next turn of a chat recomputes at most BLOCK - 1 of its own
DEFAULT_BUDGET_BYTES = 1 << 30
MAX_ENTRIES = 64  # caches kept beyond live requests' (each holds a slot of the engine's pool)
KEY_CHARS = 24  # a key in hex (96 bits)
MAX_KEYS = 1 << 16  # blocks of the longest prompt a peer may name


def block_keys(model_id: str, tokens: np.ndarray) -> List[str]:
  """The key of each whole block of `tokens`, in order."""
  ids = np.ascontiguousarray(np.asarray(tokens).reshape(-1), dtype=np.int64)
  keys, key = [], hashlib.blake2b(model_id.encode(), digest_size=KEY_CHARS // 2).digest()
  for start in range(0, len(ids) - BLOCK + 1, BLOCK):
    key = hashlib.blake2b(key + ids[start:start + BLOCK].tobytes(), digest_size=KEY_CHARS // 2).digest()
    keys.append(key.hex())
  return keys


@dataclass(eq=False)
class Entry:
  cache: object  # the engine's KV cache; its first len(keys) * BLOCK positions hold the prefix
  keys: List[str]
  request_id: Optional[str] = None  # the request whose cache it is, until another takes the cache over
  positions: Dict[str, int] = field(default_factory=dict)  # key -> positions up to the end of its block

  def __post_init__(self):
    self.positions = {key: (i + 1) * BLOCK for i, key in enumerate(self.keys)}


def starts_from(cache, positions: int) -> bool:
  """Whether the cache's first `positions` positions can start a request. A cache that keeps only a sliding
  layer's window (the numpy engine's) may have let go of what such a request would see; the others keep them all."""
  holds = getattr(cache, "holds_prefix", None)
  return holds is None or holds(positions)


class PrefixStore:
  """Entries by the keys they hold, least recently used first. `live()` gives the ids of the caches live requests
  use; `nbytes(cache)` what a cache occupies."""

  def __init__(self, budget_bytes: int, live: Callable[[], Set[int]], nbytes: Callable[[object], int]):
    self.budget_bytes, self.live, self.nbytes = budget_bytes, live, nbytes
    self.enabled = budget_bytes > 0  # off: nothing is filed or found
    self.entries: "OrderedDict[int, Entry]" = OrderedDict()  # id(entry) -> entry, least recently used first
    self.by_key: Dict[str, List[Entry]] = {}
    self.by_request: Dict[str, Entry] = {}
    self.hits = self.reused_positions = 0
    self._lock = threading.Lock()  # the engine's thread files, finds and evicts; the event loop reads its size

  def set_budget(self, budget_bytes: int) -> None:
    """A new budget; 0 turns the store off."""
    with self._lock:
      self.budget_bytes, self.enabled = budget_bytes, budget_bytes > 0
      self._evict()

  def longest(self, keys: List[str], limit: int) -> Tuple[Optional[Entry], int]:
    """The entry holding the longest prefix of `keys` of at most `limit` positions that can start a request, and
    that many positions."""
    with self._lock:
      for key in reversed(keys[:limit // BLOCK]):  # a key held means every key before it is held too
        for entry in reversed(self.by_key.get(key, ())):
          if starts_from(entry.cache, entry.positions[key]):
            self.entries.move_to_end(id(entry))
            return entry, entry.positions[key]
    return None, 0

  def add(self, cache, keys: List[str], request_id: Optional[str] = None) -> None:
    """File `cache` under `keys` (its prompt's blocks that it holds), unless another entry holds them all already."""
    if not self.enabled or not keys:
      return
    with self._lock:
      held = self.by_key.get(keys[-1])
      if held and starts_from(held[-1].cache, held[-1].positions[keys[-1]]):
        # the same prefix: the older entry stays, freshly used (and is this request's, if it took its cache over)
        older = held[-1]
        self.entries.move_to_end(id(older))
        if older.cache is cache:
          self._own(older, request_id)
        return
      self._file(Entry(cache, list(keys), request_id))

  def extend(self, request_id: str, keys: List[str], held: Callable[[object], int]) -> None:
    """The request's entry, if it still has one, now under `keys`: the blocks of its prompt, then more, as far as its
    cache holds them (`held(cache)` positions)."""
    with self._lock:
      entry = self.by_request.get(request_id)
      if entry is None:
        return
      keys = keys[:held(entry.cache) // BLOCK]
      if len(keys) <= len(entry.keys) or keys[:len(entry.keys)] != entry.keys:  # nothing new, or not its prompt's
        return
      self._remove(entry)
      self._file(Entry(entry.cache, keys, request_id))

  def take_over(self, entry: Entry, positions: int, request_id: str) -> None:
    """A new request uses `entry`'s cache itself and writes past `positions`: the entry keeps only the blocks before."""
    with self._lock:
      if id(entry) not in self.entries:
        return
      for key in entry.keys[positions // BLOCK:]:
        self._unindex(entry, key)
      entry.keys = entry.keys[:positions // BLOCK]
      entry.positions = {key: entry.positions[key] for key in entry.keys}
      self._own(entry, request_id)

  def _file(self, entry: Entry) -> None:
    for older in [e for e in self.entries.values() if e.keys[-1] in entry.positions]:
      self._remove(older)  # the new entry holds all of it
    self.entries[id(entry)] = entry
    for key in entry.keys:
      self.by_key.setdefault(key, []).append(entry)
    self._own(entry, entry.request_id)
    self._evict()

  def _own(self, entry: Entry, request_id: Optional[str]) -> None:
    if self.by_request.get(entry.request_id) is entry:
      del self.by_request[entry.request_id]
    entry.request_id = request_id
    if request_id is not None:
      self.by_request[request_id] = entry

  def trim(self) -> None:
    """Evict down to the budget (a request ended, so its cache may now count against it)."""
    with self._lock:
      self._evict()

  def _evict(self) -> None:
    live = self.live()
    kept = [e for e in self.entries.values() if id(e.cache) not in live]  # least recently used first
    total, count = sum(self.nbytes(e.cache) for e in kept), len(kept)
    for entry in kept:
      if total <= self.budget_bytes and count <= MAX_ENTRIES:
        break
      self._remove(entry)
      total, count = total - self.nbytes(entry.cache), count - 1

  def _remove(self, entry: Entry) -> None:
    del self.entries[id(entry)]
    for key in entry.keys:
      self._unindex(entry, key)
    self._own(entry, None)

  def _unindex(self, entry: Entry, key: str) -> None:
    held = self.by_key[key]
    held.remove(entry)
    if not held:
      del self.by_key[key]

  def clear(self) -> None:
    with self._lock:
      self.entries.clear()
      self.by_key.clear()
      self.by_request.clear()

  def held_bytes(self) -> int:
    """Memory only the store keeps (caches no live request uses)."""
    with self._lock:
      live = self.live()
      return sum(self.nbytes(e.cache) for e in self.entries.values() if id(e.cache) not in live)


def checked_prefix(data) -> dict:
  """A request's `prefix` as its inference state carries it from the first node: {"keys": its prompt's block keys,
  "reuse": the positions every node takes from its cache}. ValueError if a peer sent something unusable."""
  if not isinstance(data, dict) or set(data) != {"keys", "reuse"}:
    raise ValueError("inference state prefix must be an object with keys and reuse")
  keys, reuse = checked_keys(data["keys"], "inference state prefix.keys"), data["reuse"]
  if not isinstance(reuse, int) or isinstance(reuse, bool) or reuse % BLOCK or not 0 <= reuse <= len(keys) * BLOCK:
    raise ValueError(f"inference state prefix.reuse must be a whole number of {BLOCK}-token blocks it names, got {reuse!r}")
  return data


def checked_keys(keys, what: str) -> List[str]:
  """Block keys a peer sent; ValueError naming `what` if they are not."""
  if not isinstance(keys, list) or len(keys) > MAX_KEYS or not all(isinstance(k, str) and len(k) == KEY_CHARS for k in keys):
    raise ValueError(f"{what} must be a list of at most {MAX_KEYS} block keys")
  return keys


class PrefixReuse:
  """The engine contract's prefix methods (exo/inference/inference_engine.py), mixed into an engine that keeps
  `caches` (request id -> KV cache: `length`, `nbytes`, `copy_prefix(source, positions)`), makes new caches with
  `model.new_cache()`, and runs its model work in order on one thread (`executor`, `_run(fn, *args)`). Every call
  runs on that thread, in order with the steps. The engine creates `self.prefixes` (new_prefix_store)."""

  copies_prefixes = True
  prefixes: PrefixStore

  def new_prefix_store(self) -> PrefixStore:
    return PrefixStore(DEFAULT_BUDGET_BYTES, lambda: {id(c) for c in list(self.caches.values())}, lambda c: c.nbytes)

  @property
  def reuses_prefixes(self) -> bool:
    return self.prefixes.enabled

  def set_prefix_budget(self, budget_bytes: int) -> None:
    self.prefixes.set_budget(budget_bytes)

  async def start_from_prefix(self, request_id: str, shard, keys: List[str], limit: int) -> int:
    """Begin the request's KV cache afresh (any it holds is dropped) with the longest cached prefix of `keys`, its
    prompt's block keys, of at most `limit` positions. Returns the positions it starts with (0: none held). A
    request's first message at a node may be this call, not a step: the shard is loaded first, as for a step."""
    await self.ensure_shard(shard)
    self.prefix_starts_queued += 1  # the step loop lets the request into its next step rather than leave it a step behind
    try:
      return await self._run(self._start_from_prefix, request_id, shard, keys, limit)
    finally:
      self.prefix_starts_queued -= 1

  def _start_from_prefix(self, request_id: str, shard, keys: List[str], limit: int) -> int:
    if self.shard != shard:
      raise RuntimeError(f"the engine now holds {self.shard}, not {shard}")
    self.caches.pop(request_id, None)
    entry, positions = self.prefixes.longest(keys, limit) if self.reuses_prefixes else (None, 0)
    if entry is None:
      return 0
    if id(entry.cache) in self.prefixes.live():
      cache = self.caches[request_id] = self.model.new_cache()
      cache.copy_prefix(entry.cache, positions)
    else:  # only the store holds it: this request takes it over and writes past the prefix, no copy
      cache = self.caches[request_id] = entry.cache
      self.prefixes.take_over(entry, positions, request_id)
      cache.length = positions
    self.prefixes.hits += 1
    self.prefixes.reused_positions += positions
    return positions

  def remember_prefix(self, request_id: str, keys: List[str]) -> None:
    """File the request's cache under the keys of its prompt's blocks, once its prompt has run here. Queued on the
    engine's thread without waiting: every later step and prefix lookup comes after it."""
    if self.reuses_prefixes:
      self.executor.submit(self._remember_prefix, request_id, keys)

  def _remember_prefix(self, request_id: str, keys: List[str]) -> None:
    cache = self.caches.get(request_id)
    if cache is not None:
      self.prefixes.add(cache, keys[:cache.length // BLOCK], request_id)

  def extend_prefix(self, request_id: str, keys: List[str]) -> None:
    """The request has finished: its entry is filed under `keys`, its prompt's blocks and then its answer's, as far
    as its cache holds them. Queued like remember_prefix."""
    if self.reuses_prefixes:
      self.executor.submit(self.prefixes.extend, request_id, keys, lambda cache: cache.length)

  def prefix_cache_bytes(self) -> int:
    return self.prefixes.held_bytes()

  def prefix_cache_state(self) -> dict:
    if not self.reuses_prefixes:
      return {"enabled": False}
    store = self.prefixes
    return {"enabled": True, "bytes": store.held_bytes(), "entries": len(store.entries), "hits": store.hits,
            "reused_positions": store.reused_positions}

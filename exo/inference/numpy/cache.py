"""The numpy engine's KV cache: one pool per model, a slot in it per request.

A slot holds one request's keys and values for every layer of the shard, (layers, k/v, kv heads, positions, head
dim), with room for the model's whole context. Slots lie side by side at a fixed stride in large anonymous
mappings (slabs of SLAB_SLOTS), and a request takes the lowest free slot: the requests of a step then mostly sit in
consecutive slots, and consecutive slots are one strided array, so attention for all of them is one batched product
that reads the cache where it lies (see attention.py). A pool of small blocks scattered in memory, as vLLM pages its
cache, would have to gather every request's blocks into one array first, for every layer of every step: that copy
alone took as long as the attention (27-43 ms a step for 64 requests of 128 positions, on this 2-core VM).

Keys and values are stored as float32, or with EXO_KV_BITS=16 as float16 (kv_dtype()), half the bytes, as llama.cpp
keeps its cache by default. float16 is not the default: widening costs decode 15-20% at 512 positions (attention.py
widens each block it reads and computes in float32), and a prompt whose prefix came from the prefix cache rounds
otherwise than one computed afresh (a product's summation order depends on the step's rows), which can change a
seeded sample at a high temperature.

Memory follows use. A slot is only address space until written: the kernel maps 4 KiB pages as positions are
written (no huge pages: a huge page may first need the kernel to compact memory, which stalled steps by up to 250
ms), and they go back to it when the request ends. A sliding-window layer's query never sees a position `window` or
more before its own, so as a request advances, the pages of its sliding layers' rows that hold only such positions
go back to the kernel too: a sliding layer holds its window, not the request. They go a quarter of a window at a
time (at least a page), one madvise per row: a madvise of a mapped page took 13 us on this VM, so one per row per
page crossed would cost a 2B Gemma about 1 ms a token a request, and the quarter keeps the cost to a few calls a
window for at most a quarter more memory. `nbytes` counts the pages a cache really holds.

Slots are reference-counted. The prefix cache (exo/inference/prefix_cache.py) keeps a finished request's cache
object, and with it its slot, while its prompt may serve later requests; a request that reuses it copies those
positions into its own slot."""
import math
import mmap
import sys
import threading
import weakref
from typing import List, Optional, Sequence, Tuple

import numpy as np

from exo import settings



def kv_dtype() -> np.dtype:
  """The cache's element type on this node (EXO_KV_BITS)."""
  return np.dtype(np.float16 if settings.env_int("EXO_KV_BITS") == 16 else np.float32)


SLAB_SLOTS = 64  # the most requests one batched attention product can take
# Linux's flag (Python 3.11's mmap module lacks the name): the slab is address space, not memory set aside.
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


class KVPool:
  """Slots of `positions` positions for n_layers layers; `slabs[i]` is (SLAB_SLOTS, layers, planes, kv heads,
  positions, head dim) and slot number n lies in slab n // SLAB_SLOTS. Two planes hold keys and values; one, keys
  that are their own values (latent attention's latent and RoPE key: one KV head, read as both).

  `sliding`: the slot's layers (0 for the shard's first) whose queries see only the last `window` positions."""

  def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, positions: int, planes: int = 2, dtype=None,
               window: Optional[int] = None, sliding: Sequence[int] = ()):
    self.positions = -(-positions // 1024) * 1024  # a whole number of pages per (layer, k/v, head) row
    self.slot_shape = (n_layers, planes, n_kv_heads, self.positions, head_dim)
    self.dtype = kv_dtype() if dtype is None else np.dtype(dtype)
    self.slot_bytes = math.prod(self.slot_shape) * self.dtype.itemsize
    self.position_bytes = head_dim * self.dtype.itemsize  # of one position in one row
    self.row_bytes = self.positions * self.position_bytes
    self.window = window if window is not None and len(sliding) else None
    self.sliding = tuple(sorted(sliding)) if self.window is not None else ()
    # where each sliding layer's rows start in a slot, in bytes
    self.sliding_rows = [((layer * planes + plane) * n_kv_heads + head) * self.row_bytes
                         for layer in self.sliding for plane in range(planes) for head in range(n_kv_heads)]
    # bytes of a row handed back at a time: a quarter of the window's, whole pages, at least one
    self.forget_step = max(mmap.PAGESIZE, (self.window or 0) * self.position_bytes // 4 // mmap.PAGESIZE * mmap.PAGESIZE)
    self.slabs: List[np.ndarray] = []
    self._slab_addresses: List[int] = []  # where each slab starts in memory (a slab never moves)
    self._maps: List[mmap.mmap] = []
    self.refs: List[int] = []  # per slot
    self._lock = threading.Lock()  # slots may be freed from another thread than the one stepping the model

  def _add_slab(self) -> None:
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    buffer = mmap.mmap(-1, SLAB_SLOTS * self.slot_bytes, flags=flags)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
      buffer.madvise(mmap.MADV_NOHUGEPAGE)
    self._maps.append(buffer)
    self.slabs.append(np.frombuffer(buffer, dtype=self.dtype).reshape((SLAB_SLOTS,) + self.slot_shape))
    self._slab_addresses.append(self.slabs[-1].ctypes.data)
    self.refs += [0] * SLAB_SLOTS

  def take(self) -> int:
    """The lowest free slot, with one reference."""
    with self._lock:
      slot = next((i for i, n in enumerate(self.refs) if n == 0), None)
      if slot is None:
        slot = len(self.refs)
        self._add_slab()
      self.refs[slot] = 1
      return slot

  def retain(self, slot: int) -> None:
    with self._lock:
      self.refs[slot] += 1

  def release(self, slot: int) -> None:
    """Drop a reference; the last one hands the slot's pages back to the kernel (they read as zeros again)."""
    with self._lock:
      self.refs[slot] -= 1
      if self.refs[slot] == 0:
        slab, index = divmod(slot, SLAB_SLOTS)
        self._maps[slab].madvise(mmap.MADV_DONTNEED, index * self.slot_bytes, self.slot_bytes)

  def forget(self, slot: int, start: int, end: int) -> None:
    """Hand back bytes start..end (whole pages) of each sliding row of the slot: positions no query sees again."""
    slab, index = divmod(slot, SLAB_SLOTS)
    buffer, base = self._maps[slab], index * self.slot_bytes
    for row in self.sliding_rows:
      buffer.madvise(mmap.MADV_DONTNEED, base + row + start, end - start)

  def unseen_bytes(self, length: int) -> int:
    """Bytes at the start of a sliding row, whole pages, that hold only positions the next query of a request of
    `length` positions no longer sees (it sees from length + 1 - window on)."""
    if self.window is None:
      return 0
    first_seen = max(0, length + 1 - self.window)
    return first_seen * self.position_bytes // mmap.PAGESIZE * mmap.PAGESIZE

  def slot_address(self, slot: int) -> int:
    """Where the slot starts in memory, for compiled code that writes it (fused_decode.py)."""
    slab, index = divmod(slot, SLAB_SLOTS)
    return self._slab_addresses[slab] + index * self.slot_bytes

  def where(self, slot: int) -> Tuple[np.ndarray, int]:
    """(its slab, its index there)."""
    slab, index = divmod(slot, SLAB_SLOTS)
    return self.slabs[slab], index


class KVCache:
  """One request's place in the pool: its slot and how many positions are written. The slot is released when the
  cache is dropped (the engine drops it when the request ends). `forgotten`: bytes at the start of each sliding
  row handed back already (they read as zeros)."""

  def __init__(self, pool: KVPool):
    self.pool, self.slot, self.length, self.forgotten = pool, pool.take(), 0, 0
    self.address = pool.slot_address(self.slot)
    weakref.finalize(self, pool.release, self.slot)

  def advance(self, positions: int) -> None:
    """`positions` more are written: the sliding rows' pages the next query no longer sees go back, once they
    make pool.forget_step."""
    self.length += positions
    unseen = self.pool.unseen_bytes(self.length)
    if unseen >= self.forgotten + self.pool.forget_step:
      self.pool.forget(self.slot, self.forgotten, unseen)
      self.forgotten = unseen

  def holds_prefix(self, positions: int) -> bool:
    """Whether its first `positions` positions can start another request: every position that request's next
    query sees is still held (a sliding layer's older pages may have gone back)."""
    return positions <= self.length and self.pool.unseen_bytes(positions) >= self.forgotten

  @property
  def capacity(self) -> int:
    return self.pool.positions

  @property
  def data(self) -> np.ndarray:
    """(layers, planes, kv heads, positions, head dim), a view of the slot."""
    slab, index = self.pool.where(self.slot)
    return slab[index]

  def copy_prefix(self, source: "KVCache", positions: int) -> None:
    """Start with the first `positions` positions of `source`: a copy of a few MB, far cheaper than computing them.
    A sliding layer's rows take only the pages its next query sees (source.holds_prefix(positions) must hold)."""
    pool = self.pool
    self.forgotten = pool.unseen_bytes(positions)  # never written here: nothing to hand back
    first = self.forgotten // pool.position_bytes
    mine, theirs = self.data, source.data
    if not pool.sliding:
      mine[:, :, :, :positions] = theirs[:, :, :, :positions]
    for layer in range(pool.slot_shape[0]) if pool.sliding else ():
      start = first if layer in pool.sliding else 0
      mine[layer, :, :, start:positions] = theirs[layer, :, :, start:positions]
    self.length = positions

  @property
  def nbytes(self) -> int:
    """Memory in use: the pages the written positions occupy in each (layer, k/v, head) row, less the pages the
    sliding rows have handed back."""
    layers, planes, heads, _, _ = self.pool.slot_shape
    row = -(-self.length * self.pool.position_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
    sliding = len(self.pool.sliding_rows)
    return (layers * planes * heads - sliding) * row + sliding * max(0, row - self.forgotten)

"""The MLX engine's KV cache: one per request, its capacity doubling as the request grows.

A sliding-window layer's query never sees a position `window` or more before its own, so its arrays keep only the
positions from `start` on: once a whole window's worth lies before what the next query sees, they are cut down to
what it sees (a copy of about a window, once every window positions: a position costs one copy at most). A
sliding layer thus holds between one and two windows, not the request."""
from typing import List, Optional, Sequence

import mlx.core as mx

MIN_CAPACITY = 64


class KVCache:
  """One request's keys and values: per layer one (n_kv_heads, capacity, head_dim) array each, index i holding
  position i (a sliding layer's: position start + i); only positions before `length` are ever read. With one plane,
  keys alone (latent attention reads them as values too). `sliding`: the layers that slide over `window`."""

  def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32, capacity: int = MIN_CAPACITY,
               planes: int = 2, window: Optional[int] = None, sliding: Sequence[int] = ()):
    self.keys = [mx.zeros((n_kv_heads, capacity, head_dim), dtype=dtype) for _ in range(n_layers)]
    self.values = [mx.zeros((n_kv_heads, capacity, head_dim), dtype=dtype) for _ in range(n_layers if planes == 2 else 0)]
    self.length, self.start = 0, 0
    self.window = window if window is not None and len(sliding) else None
    self.sliding = frozenset(sliding) if self.window is not None else frozenset()

  def origin(self, layer: int) -> int:
    """The position index 0 of the layer's arrays holds."""
    return self.start if layer in self.sliding else 0

  def reserve(self, length: int) -> None:
    """Room for positions up to `length` in every layer."""
    for layer in range(len(self.keys)):
      capacity, needed = self.keys[layer].shape[1], length - self.origin(layer)
      if needed > capacity:
        self._resize(layer, 0, max(needed, 2 * capacity))

  def _resize(self, layer: int, drop: int, capacity: int) -> None:
    """The layer's arrays from index `drop` on, `capacity` long (a new array, not a view that would keep the old
    one's memory; what lay past capacity was never written)."""
    for arrays in (self.keys, self.values) if self.values else (self.keys,):
      kept = arrays[layer][:, drop:drop + capacity]
      arrays[layer] = mx.pad(kept, [(0, 0), (0, capacity - kept.shape[1]), (0, 0)])

  def advance(self, length: int) -> None:
    """Positions up to `length` are written: a sliding layer lets go of those its next query no longer sees, once
    they make a window's worth."""
    self.length = length
    if self.window is None:
      return
    first_seen, least_drop = max(0, length + 1 - self.window), max(self.window, MIN_CAPACITY)
    drop = first_seen - self.start
    if drop >= least_drop:
      for layer in self.sliding:  # room for what it holds until the next cut
        self._resize(layer, drop, max(length - first_seen, self.window) + least_drop)
      self.start = first_seen

  def holds_prefix(self, positions: int) -> bool:
    """Whether its first `positions` positions can start another request: every position that request's next
    query sees is still held."""
    return positions <= self.length and (self.window is None or self.start <= max(0, positions + 1 - self.window))

  def copy_prefix(self, source: "KVCache", positions: int) -> None:
    """Start with the first `positions` positions of `source` (evaluated now: the source goes on growing); a
    sliding layer's from where the source's start (source.holds_prefix(positions) must hold)."""
    self.start = source.start if self.sliding else 0
    self.reserve(positions)
    for layer in range(len(self.keys)):
      held = positions - self.origin(layer)
      for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
        if mine:
          mine[layer][:, :held] = theirs[layer][:, :held]
    mx.eval(self.arrays())
    self.length = positions

  def arrays(self) -> List[mx.array]:
    return self.keys + self.values

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays())

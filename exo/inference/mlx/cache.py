"""The MLX engine's KV cache: one per request, its capacity doubling as the request grows."""
from typing import List

import mlx.core as mx

MIN_CAPACITY = 64


class KVCache:
  """One request's keys and values: per layer one (n_kv_heads, capacity, head_dim) array each; only the first
  `length` positions are ever read. With one plane, keys alone (latent attention reads them as values too)."""

  def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32, capacity: int = MIN_CAPACITY,
               planes: int = 2):
    self.keys = [mx.zeros((n_kv_heads, capacity, head_dim), dtype=dtype) for _ in range(n_layers)]
    self.values = [mx.zeros((n_kv_heads, capacity, head_dim), dtype=dtype) for _ in range(n_layers if planes == 2 else 0)]
    self.capacity, self.length = capacity, 0

  def reserve(self, length: int) -> None:
    if length <= self.capacity:
      return
    grown = max(length, 2 * self.capacity)
    pad = [(0, 0), (0, grown - self.capacity), (0, 0)]
    self.keys = [mx.pad(k, pad) for k in self.keys]
    self.values = [mx.pad(v, pad) for v in self.values]
    self.capacity = grown

  def copy_prefix(self, source: "KVCache", positions: int) -> None:
    """Start with the first `positions` positions of `source` (evaluated now: the source goes on growing)."""
    self.reserve(positions)
    for mine, theirs in zip(self.arrays(), source.arrays()):
      mine[:, :positions] = theirs[:, :positions]
    mx.eval(self.arrays())
    self.length = positions

  def arrays(self) -> List[mx.array]:
    return self.keys + self.values

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays())

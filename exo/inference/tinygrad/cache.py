"""The tinygrad engine's KV cache: one per request, its capacity growing in bucketed sizes (fewer distinct shapes,
fewer jits and kernels to generate)."""
import math

import numpy as np
from tinygrad import Tensor

MIN_CAPACITY = 64


def bucket(n: int, least: int = 1) -> int:
  """n rounded up to a power of two (past 64: to a multiple of 64), at least `least`: padded shapes keep the number
  of distinct kernels and jits small, without doubling the work of long prompts."""
  n = max(n, least)
  return 1 << max(n - 1, 0).bit_length() if n <= 64 else -(-n // 64) * 64


class KVCache:
  """One request's keys and values: per layer one (2, n_kv_heads, capacity, head_dim) tensor, capacity doubling as
  the request grows. Positions past `length` may hold padding garbage; the attention mask never lets a query see them."""

  def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype=np.float32, capacity: int = MIN_CAPACITY):
    self.kv = [Tensor(np.zeros((2, n_kv_heads, capacity, head_dim), dtype=dtype)).realize() for _ in range(n_layers)]
    self.capacity, self.length = capacity, 0

  def reserve(self, length: int) -> None:
    if length <= self.capacity:
      return
    grown = max(bucket(length), 2 * self.capacity)
    self.kv = [t.pad(((0, 0), (0, 0), (0, grown - self.capacity), (0, 0))).contiguous() for t in self.kv]
    Tensor.realize(*self.kv)
    self.capacity = grown

  def copy_prefix(self, source: "KVCache", positions: int) -> None:
    """Start with the first `positions` positions of `source`."""
    self.reserve(positions)
    pad = ((0, 0), (0, 0), (0, self.capacity - positions), (0, 0))
    self.kv = [t[:, :, :positions].pad(pad).contiguous() for t in source.kv]
    Tensor.realize(*self.kv)
    self.length = positions

  @property
  def nbytes(self) -> int:
    return sum(math.prod(t.shape) * t.dtype.itemsize for t in self.kv)

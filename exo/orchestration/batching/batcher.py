"""What batching's parts share: the tally of how many requests each engine step or sampling call carried, and
the error a request waiting for a step gets when the node stops."""
from collections import Counter


class BatcherStopped(RuntimeError):
  """The node is stopping: the item was not run."""


class BatchStats:
  """How many items each flush (or engine step) carried."""

  def __init__(self) -> None:
    self.sizes: Counter = Counter()

  def record(self, size: int) -> None:
    self.sizes[size] += 1

  @property
  def flushes(self) -> int:
    return sum(self.sizes.values())

  @property
  def mean(self) -> float:
    return sum(size * n for size, n in self.sizes.items()) / max(1, self.flushes)

  def __str__(self) -> str:
    histogram = " ".join(f"{size}:{n}" for size, n in sorted(self.sizes.items()))
    return f"{self.flushes} batches, mean size {self.mean:.2f}, sizes {{{histogram}}}"

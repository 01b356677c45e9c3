"""An async micro-batcher: callers submit items under a key and each gets back its own result or exception;
the batcher runs the items of one key together in groups.

A group is flushed when it is full, when its first item has waited `timeout_s`, or as soon as the owner says no
other item can join it (`nothing_else_coming`), so a lone request never pays the timeout. The timer only starts
a flush; a flush runs in a task of its own that nothing ever cancels, so a group is never half-done or dropped.
`stop()` fails whatever has not been flushed and waits for the flushes under way to finish."""
import asyncio
from collections import Counter
from typing import Awaitable, Callable, Dict, Generic, Hashable, List, Optional, Sequence, Set, Tuple, TypeVar, Union

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")
R = TypeVar("R")


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


class Batcher(Generic[K, T, R]):
  def __init__(self, run: Callable[[K, List[T]], Awaitable[Sequence[Union[R, BaseException]]]], max_size: int, timeout_s: float,
               nothing_else_coming: Callable[[K, int], bool] = lambda key, waiting: False):
    """run(key, items) returns one result per item, in order; an exception in the list fails only that item."""
    self.run, self.max_size, self.timeout_s, self.nothing_else_coming = run, max_size, timeout_s, nothing_else_coming
    self.stats = BatchStats()
    self._pending: Dict[K, List[Tuple[T, asyncio.Future]]] = {}
    self._timers: Dict[K, asyncio.TimerHandle] = {}
    self._flushing: Set[asyncio.Task] = set()
    self._stopped = False

  async def submit(self, key: K, item: T) -> R:
    if self._stopped:
      raise BatcherStopped("batching has stopped on this node")
    future = asyncio.get_running_loop().create_future()
    group = self._pending.setdefault(key, [])
    group.append((item, future))
    if len(group) >= self.max_size or self.nothing_else_coming(key, len(group)):
      self._flush(key)
    elif key not in self._timers:
      self._timers[key] = asyncio.get_running_loop().call_later(self.timeout_s, self._flush, key)
    return await future

  def poke(self, key: K) -> None:
    """The owner's accounting changed (a request left): flush now if nothing else can join."""
    group = self._pending.get(key)
    if group and self.nothing_else_coming(key, len(group)):
      self._flush(key)

  def waiting(self, key: Optional[K] = None) -> int:
    """Items waiting for a flush: under `key`, or under every key."""
    return len(self._pending.get(key, ())) if key is not None else sum(map(len, self._pending.values()))

  @property
  def flushing(self) -> int:
    """Groups being run now."""
    return len(self._flushing)

  @property
  def idle(self) -> bool:
    """Nothing waiting for a flush, no timer set, no flush running."""
    return not any(self._pending.values()) and not self._timers and not self._flushing

  def _flush(self, key: K) -> None:
    timer = self._timers.pop(key, None)
    if timer is not None:
      timer.cancel()  # a TimerHandle, not the flush: cancelling it cannot drop anything
    group = [(item, future) for item, future in self._pending.pop(key, []) if not future.done()]  # done = caller gone
    if group:
      task = asyncio.get_running_loop().create_task(self._run_group(key, group))
      self._flushing.add(task)
      task.add_done_callback(self._flushing.discard)

  async def _run_group(self, key: K, group: List[Tuple[T, asyncio.Future]]) -> None:
    self.stats.record(len(group))
    try:
      results = list(await self.run(key, [item for item, _ in group]))
      if len(results) != len(group):
        raise RuntimeError(f"batch of {len(group)} returned {len(results)} results")
    except asyncio.CancelledError:  # only when the event loop itself is torn down: nothing here cancels a flush
      for _, future in group:
        future.cancel()
      raise
    except Exception as e:  # the whole group failed: every item learns why
      results = [e] * len(group)
    for (_, future), result in zip(group, results):
      if future.done():
        continue
      if isinstance(result, BaseException):
        future.set_exception(result)
      else:
        future.set_result(result)

  async def stop(self) -> None:
    self._stopped = True
    for timer in self._timers.values():
      timer.cancel()
    self._timers.clear()
    pending, self._pending = self._pending, {}
    for group in pending.values():
      for _, future in group:
        if not future.done():
          future.set_exception(BatcherStopped("node stopping"))
    while self._flushing:
      await asyncio.gather(*list(self._flushing), return_exceptions=True)

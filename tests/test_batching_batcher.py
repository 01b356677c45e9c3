"""The micro-batcher on its own: flush at size, at timeout, or when nothing else can come; per-item results;
a flush that suspends is never cancelled (upstream hung with fewer requests than the batch size); stop settles all."""
import asyncio
import time

import pytest

from exo.orchestration.batching.batcher import Batcher, BatcherStopped
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit


def echo(delay=0.0, log=None):
  async def run(key, items):
    if log is not None:
      log.append((key, list(items)))
    await asyncio.sleep(delay)  # a flush that really suspends
    return [(key, item) for item in items]
  return run


def leftover_tasks():
  return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def test_full_batch_flushes_at_once():
  log = []
  batcher = Batcher(echo(log=log), max_size=4, timeout_s=60)
  results = await asyncio.wait_for(asyncio.gather(*[batcher.submit("k", i) for i in range(4)]), 5)
  assert results == [("k", i) for i in range(4)]
  assert log == [("k", [0, 1, 2, 3])] and batcher.stats.sizes == {4: 1}


async def test_timeout_flush_of_a_small_batch_that_suspends_completes():
  batcher = Batcher(echo(delay=0.05), max_size=8, timeout_s=0.01)
  start = time.monotonic()
  results = await asyncio.wait_for(asyncio.gather(*[batcher.submit("k", i) for i in range(3)]), 5)
  assert results == [("k", 0), ("k", 1), ("k", 2)]
  assert time.monotonic() - start < 2
  assert batcher.stats.sizes == {3: 1}
  assert not leftover_tasks()


async def test_keys_are_batched_apart():
  log = []
  batcher = Batcher(echo(log=log), max_size=2, timeout_s=0.01)
  await asyncio.gather(*[batcher.submit(key, i) for i, key in enumerate("abab")])
  assert sorted(log) == [("a", [0, 2]), ("b", [1, 3])]


async def test_a_lone_item_pays_no_timeout_when_nothing_else_can_come():
  batcher = Batcher(echo(), max_size=8, timeout_s=30, nothing_else_coming=lambda key, waiting: True)
  start = time.monotonic()
  assert await asyncio.wait_for(batcher.submit("k", 1), 5) == ("k", 1)
  assert time.monotonic() - start < 1


async def test_poke_flushes_when_the_awaited_item_will_not_come():
  coming = {"x"}
  batcher = Batcher(echo(), max_size=8, timeout_s=30, nothing_else_coming=lambda key, waiting: not coming)
  waiting = asyncio.ensure_future(batcher.submit("k", 1))
  await eventually(lambda: batcher.waiting("k") == 1, 5)
  assert not waiting.done()
  coming.clear()
  batcher.poke("k")
  assert await asyncio.wait_for(waiting, 5) == ("k", 1)


async def test_each_item_gets_its_own_result_or_exception():
  async def run(key, items):
    await asyncio.sleep(0)
    return [ValueError(f"bad {i}") if i % 3 == 0 else i * 10 for i in items]
  batcher = Batcher(run, max_size=6, timeout_s=0.01)
  results = await asyncio.gather(*[batcher.submit("k", i) for i in range(6)], return_exceptions=True)
  assert [str(r) if isinstance(r, Exception) else r for r in results] == ["bad 0", 10, 20, "bad 3", 40, 50]


async def test_a_failing_run_fails_each_item_and_the_batcher_goes_on():
  calls = []
  async def run(key, items):
    calls.append(list(items))
    if len(calls) == 1:
      raise RuntimeError("engine down")
    return list(items)
  batcher = Batcher(run, max_size=2, timeout_s=0.01)
  first = await asyncio.gather(batcher.submit("k", 1), batcher.submit("k", 2), return_exceptions=True)
  assert all(isinstance(r, RuntimeError) for r in first)
  assert await asyncio.gather(batcher.submit("k", 3), batcher.submit("k", 4)) == [3, 4]


async def test_a_wrong_number_of_results_is_an_error_not_a_hang():
  async def run(key, items):
    return items[:1]
  batcher = Batcher(run, max_size=2, timeout_s=0.01)
  results = await asyncio.wait_for(asyncio.gather(batcher.submit("k", 1), batcher.submit("k", 2), return_exceptions=True), 5)
  assert all(isinstance(r, RuntimeError) for r in results)


async def test_a_caller_that_leaves_is_skipped_and_the_others_run():
  log, everyone_asked = [], []
  batcher = Batcher(echo(log=log), max_size=8, timeout_s=60, nothing_else_coming=lambda key, waiting: bool(everyone_asked))
  gone = asyncio.ensure_future(batcher.submit("k", "gone"))
  stays = asyncio.ensure_future(batcher.submit("k", "stays"))
  await eventually(lambda: batcher.waiting("k") == 2, 5)
  gone.cancel()
  everyone_asked.append(True)
  batcher.poke("k")
  assert await asyncio.wait_for(stays, 5) == ("k", "stays")
  assert log == [("k", ["stays"])]


async def test_stop_fails_pending_items_and_lets_running_flushes_finish():
  release = asyncio.Event()

  async def run(key, items):
    await release.wait()  # a flush that really suspends, until the test lets it finish
    return [(key, item) for item in items]
  batcher = Batcher(run, max_size=2, timeout_s=60)
  running = [asyncio.ensure_future(batcher.submit("k", i)) for i in range(2)]  # full: flushing, suspended
  pending = asyncio.ensure_future(batcher.submit("k", 2))  # waits for a partner that never comes
  await eventually(lambda: batcher.flushing == 1 and batcher.waiting("k") == 1, 5)
  stopping = asyncio.ensure_future(batcher.stop())
  with pytest.raises(BatcherStopped):
    await asyncio.wait_for(pending, 5)  # at once, while the flush under way goes on
  assert not stopping.done()
  release.set()
  await asyncio.wait_for(stopping, 5)
  assert [r.result() for r in running] == [("k", 0), ("k", 1)]  # the flush under way was not cancelled
  with pytest.raises(BatcherStopped):
    await batcher.submit("k", 3)
  await eventually(lambda: not leftover_tasks(), 1)
  assert batcher.idle

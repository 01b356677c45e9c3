"""The hand-over of a call to a Llama engine's thread: the event loop lets the thread start the call before it runs
anything else (a thread must take the GIL to start, and the event loop would hold it while it ran the callbacks due),
and a call queued behind another is not waited for."""
import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from exo.inference.llama_engine import LlamaShardEngine

pytestmark = pytest.mark.unit


def engine() -> LlamaShardEngine:
  return LlamaShardEngine(None, ThreadPoolExecutor(max_workers=1))


def test_the_engine_thread_starts_a_call_before_the_event_loop_runs_its_callbacks():
  async def main():
    e, order = engine(), []
    loop = asyncio.get_running_loop()
    for _ in range(20):
      loop.call_soon(order.append, "event loop")
      await e._run(order.append, "engine")
      assert order[-2:] == ["engine", "event loop"]
    e.executor.shutdown()
  asyncio.run(main())


def test_a_call_queued_behind_another_does_not_hold_up_the_event_loop():
  async def main():
    e, release, order = engine(), threading.Event(), []
    loop, began, queued = asyncio.get_running_loop(), asyncio.Event(), asyncio.Event()

    def blocking():  # the first call: started on the thread, which it holds until released
      loop.call_soon_threadsafe(began.set)
      release.wait(10)

    queue = e._queue
    def queue_and_say(fn, *args):
      future = queue(fn, *args)
      queued.set()
      return future
    e._queue = queue_and_say

    first = asyncio.ensure_future(e._run(blocking))
    await began.wait()
    queued.clear()
    second = asyncio.ensure_future(e._run(order.append, "second"))
    await queued.wait()
    assert e._queued == 2 and order == []  # the second is queued, and the event loop goes on meanwhile
    release.set()
    await asyncio.gather(first, second)
    assert order == ["second"] and e._queued == 0
    e.executor.shutdown()
  asyncio.run(main())

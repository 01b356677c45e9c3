"""AsyncCallback: observers see every event; waiters see the latest result that satisfies them."""
import asyncio

import pytest

from exo.helpers import AsyncCallbackSystem
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit


async def test_observers_see_every_event_and_a_waiter_the_one_it_waits_for():
  callbacks = AsyncCallbackSystem()
  seen = []
  callback = callbacks.register("c")
  callback.on_next(lambda *args: seen.append(args))
  waiter = asyncio.ensure_future(callback.wait(lambda request_id, n: n >= 3, timeout=5))
  await eventually(lambda: callback.waiting == 1, 5)
  for n in range(1, 4):
    callbacks.trigger_all("r", n)
  assert await waiter == ("r", 3)
  callbacks.trigger_all("r", 4)
  assert seen == [("r", 1), ("r", 2), ("r", 3), ("r", 4)]


async def test_without_waiters_triggering_schedules_nothing():
  callbacks = AsyncCallbackSystem()
  for i in range(16):
    callbacks.register(f"stream-{i}").on_next(lambda *args: None)
  before = len(asyncio.all_tasks())
  callbacks.trigger_all("r", 1)
  assert len(asyncio.all_tasks()) == before
  assert await callbacks.register("stream-0").wait(lambda request_id, n: n == 1, timeout=5) == ("r", 1)  # latest result

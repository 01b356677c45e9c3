"""start_now: a coroutine's first step runs in the caller's turn, and the task that carries it on behaves as
asyncio's own (result, error, a failed future read by the coroutine, a bare yield, cancellation); and on a real Node
a packed message started so has its rows in their step's line before the starting turn ends (the gRPC server starts
each message this way)."""
import asyncio

import numpy as np
import pytest

from exo.inference.sampling import SamplingParams
from exo.networking.eager_start import start_now
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.routing.packing import pack
from tests.support.toy import TOY, ToyEngine, make_node
from tests.test_step_core import RecordingPeer, route

pytestmark = pytest.mark.unit


async def test_the_first_step_runs_in_the_callers_turn_and_the_task_returns_its_result():
  steps = []

  async def work():
    steps.append("first")
    await asyncio.sleep(0)  # a bare yield
    steps.append("second")
    await asyncio.sleep(0.01)  # a timer's future
    return 7

  task = start_now(work())
  assert steps == ["first"]  # before this coroutine has yielded once
  assert await task == 7 and steps == ["first", "second"]


async def test_a_coroutine_done_at_once_or_failing_at_once_gives_a_task_that_says_so():
  async def done():
    return "done"

  async def fails():
    raise ValueError("at once")

  assert await start_now(done()) == "done"
  with pytest.raises(ValueError, match="at once"):
    await start_now(fails())


async def test_a_future_that_fails_raises_in_the_coroutine_where_it_awaited():
  future = asyncio.get_running_loop().create_future()

  async def work():
    try:
      await future
    except KeyError as e:
      return f"caught {e.args[0]}"

  task = start_now(work())
  future.set_exception(KeyError("k"))
  assert await task == "caught k"


async def test_cancelling_the_task_cancels_what_the_coroutine_awaits_and_reaches_it():
  future = asyncio.get_running_loop().create_future()
  seen = []

  async def work():
    try:
      await future
    except asyncio.CancelledError:
      seen.append("cancelled")
      raise

  task = start_now(work())
  await asyncio.sleep(0)
  task.cancel()
  with pytest.raises(asyncio.CancelledError):
    await task
  assert future.cancelled() and seen == ["cancelled"]


async def test_a_packed_message_started_now_is_in_its_steps_line_before_the_turn_ends():
  node, _ = make_node(ToyEngine(step_s=0, sample_s=0), BatchingConfig(batch_size=8, timeout_ms=60_000))
  p1, o1 = RecordingPeer("p1"), RecordingPeer("o1")
  node.peers = [p1, o1]
  a = route("p1", "o1", node)
  params = SamplingParams(max_tokens=5).to_dict()
  # Its first pass here admits the request (the model gate), which waits: after that a hop goes straight into line.
  await asyncio.wait_for(node.process_tensor(TOY, np.array([[9]]), "r0", {"route": a.json, "params": params}), 10)
  tensor, state = pack([("r0", np.array([[11]]), {"route": a.json})])
  task = start_now(node.process_tensor(TOY, tensor, "r0", state))
  assert node.steps.waiting("r0")  # no turn of the event loop has passed
  await asyncio.wait_for(task, 10)
  assert node.inference_engine.batches == [1, 1]
  await node.steps.stop()

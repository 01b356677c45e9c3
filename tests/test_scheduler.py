"""Continuous batching at one node: what each engine step takes, chunked prefill, per-request errors, stop;
and on the real SmolLM2, 32 requests of different lengths arriving at random times give the same greedy
tokens batched as unbatched."""
import asyncio
import random
import time
from typing import List

import numpy as np
import pytest

from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.orchestration.batching.batcher import BatcherStopped
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.scheduler import LONE_PROMPT_CHUNK, RUNNING_AFTER, Scheduler
from exo.orchestration.forward_started import FORWARD_STARTED
from tests.support.models import smollm2_shard
from tests.support.toy import ToyEngine, make_node, settle

FIRST, LAST = Shard("toy", 0, 1, 4), Shard("toy", 2, 3, 4)
HIDDEN = 4


class StepEngine:
  """Records every step; output = input + 1 (hidden states stay hidden states), one error on request."""

  def __init__(self, delay: float = 0.0, fail=(), fail_step: int = -1):
    self.steps: List[List[tuple]] = []
    self.delay, self.fail, self.fail_step = delay, set(fail), fail_step

  async def infer_batch(self, shard, items):
    self.steps.append([(rid, np.shape(x)) for rid, x, _ in items])
    if len(self.steps) - 1 == self.fail_step:
      raise RuntimeError("the whole step broke")
    await asyncio.sleep(self.delay)
    return [ValueError(f"bad input for {rid}") if rid in self.fail else (np.asarray(x) + 1, {"seen": (state or {}).get("seen", 0) + np.shape(x)[1]})
            for rid, x, state in items]


def scheduler(engine, shard=LAST, batch_size=8, timeout_s=0.0, chunk=0, live=()):
  """`live`: the requests still going on this node; those come back to the scheduler after each step."""
  return Scheduler(engine, shard, batch_size, timeout_s, chunk, asyncio.Lock(), lambda request_id: request_id in live)


async def test_lone_request_does_not_wait_for_the_timeout():
  s = scheduler(StepEngine(), timeout_s=30)
  start = time.monotonic()
  out, _ = await asyncio.wait_for(s.infer("a", np.array([[5]]), None), 5)
  assert out.tolist() == [[6]] and time.monotonic() - start < 1
  await s.stop()


async def test_every_ready_request_shares_the_step_up_to_the_batch_size():
  engine = StepEngine(delay=0.01)
  s = scheduler(engine, batch_size=4)
  outs = await asyncio.gather(*[s.infer(f"r{i}", np.array([[i]]), None) for i in range(10)])
  assert [o.tolist() for o, _ in outs] == [[[i + 1]] for i in range(10)]
  assert [len(step) for step in engine.steps] == [4, 4, 2]
  assert [rid for step in engine.steps for rid, _ in step] == [f"r{i}" for i in range(10)]  # oldest first
  await s.stop()


async def test_a_step_waits_for_requests_on_their_way_back_but_at_most_the_timeout():
  engine = StepEngine()
  s = scheduler(engine, timeout_s=1.0, live={"b", "c"})
  await s.infer("b", np.array([[0]]), None)  # b goes on (sampled, forwarded) and will come back
  a = asyncio.ensure_future(s.infer("a", np.array([[1]]), None))
  await asyncio.sleep(0.05)
  assert len(engine.steps) == 1  # b is on its way back: a waits for it
  b = asyncio.ensure_future(s.infer("b", np.array([[2]]), None))
  await asyncio.wait_for(asyncio.gather(a, b), 5)
  assert [len(step) for step in engine.steps] == [1, 2]
  await s.infer("c", np.array([[3]]), None)  # c goes on and never comes back: the timeout bounds the wait
  start = time.monotonic()
  await asyncio.wait_for(s.infer("d", np.array([[4]]), None), 5)
  assert 0.5 < time.monotonic() - start < 4
  await s.stop()


async def test_each_request_hears_when_its_step_starts():
  """The gRPC server replies to a message when its forward pass starts (FORWARD_STARTED): for a request that waits
  in line that is its step, not its arrival, and a prompt hears it with its first chunk."""
  engine = StepEngine(delay=0.05)
  s = scheduler(engine, batch_size=1)
  heard = {}

  async def infer(request_id, x):
    started = asyncio.get_running_loop().create_future()
    FORWARD_STARTED.set(started)  # this task's own context, as the server sets it for each message
    started.add_done_callback(lambda _: heard.setdefault(request_id, len(engine.steps)))
    return await s.infer(request_id, x, None)

  await asyncio.gather(infer("prompt", np.zeros((1, LONE_PROMPT_CHUNK + 3, HIDDEN))), infer("token", np.array([[7]])))
  assert [rid for step in engine.steps for rid, _ in step] == ["prompt", "prompt", "token"]  # two chunks, then the token
  assert heard == {"prompt": 1, "token": 3}  # announced as its step began, so len(steps) counts that step
  await s.stop()


async def test_a_batch_handed_on_gathers_while_its_messages_keep_coming():
  """x is away; six requests arrive 0.08 s apart, each well within timeout_s of the last but the whole batch not
  within timeout_s of the first: they share one step. Twelve at that pace would outlast GATHER_LIMIT timeouts
  from the first, so the wait stops short of the last of them."""
  for count in (6, 12):
    engine = StepEngine()
    s = scheduler(engine, batch_size=32, timeout_s=0.2, live={"x"})
    await s.infer("x", np.array([[0]]), None)  # x goes on and stays away
    arrivals = []
    for i in range(count):
      arrivals.append(asyncio.ensure_future(s.infer(f"r{i}", np.ones((1, 3, HIDDEN)), None)))
      await asyncio.sleep(0.08)
    await asyncio.wait_for(asyncio.gather(*arrivals), 10)
    sizes = [len(step) for step in engine.steps[1:]]
    if count == 6:
      assert sizes == [6]
    else:
      assert 3 < sizes[0] < 12 and sum(sizes) == 12, sizes
    await s.stop()


async def test_a_request_that_ended_holds_nobody_up():
  engine = StepEngine()
  s = scheduler(engine, timeout_s=30, live={"b"})
  await s.infer("b", np.array([[0]]), None)
  a = asyncio.ensure_future(s.infer("a", np.array([[1]]), None))
  await asyncio.sleep(0.05)
  assert not a.done()  # b may come back
  s.forget("b")  # b ended (the node's exo_request_ended hook)
  await asyncio.wait_for(a, 5)
  await s.stop()


@pytest.mark.parametrize("shard", [FIRST, LAST])
async def test_the_first_layers_node_keeps_a_batch_together_round_the_ring(shard):
  """a and b have been spending ~0.4 s in the rest of the ring between steps. c becomes ready while they are away
  and they come back 0.1 s later, ten times timeout_s. On the first layers' node c waits for them, so all three
  share a step and go round together; elsewhere c goes alone after timeout_s."""
  engine = StepEngine()
  s = scheduler(engine, shard=shard, timeout_s=0.01, live={"a", "b", "c"})
  for t in range(3):  # the typical round trip becomes ~0.4 s
    await asyncio.gather(s.infer("a", np.array([[t]]), None), s.infer("b", np.array([[t]]), None))
    await asyncio.sleep(0.4)
  await asyncio.gather(s.infer("a", np.array([[3]]), None), s.infer("b", np.array([[3]]), None))
  assert [len(step) for step in engine.steps] == [2, 2, 2, 2]  # a and b are away now

  c = asyncio.ensure_future(s.infer("c", np.array([[0]]), None))
  if shard is LAST:
    await asyncio.wait_for(c, 5)  # completes while a and b are still away
  else:
    await asyncio.sleep(0.1)
  await asyncio.wait_for(asyncio.gather(c, s.infer("a", np.array([[4]]), None), s.infer("b", np.array([[4]]), None)), 5)
  expected = [["c", "a", "b"]] if shard is FIRST else [["c"], ["a", "b"]]
  assert [[rid for rid, _ in step] for step in engine.steps[4:]] == expected, engine.steps
  await s.stop()


@pytest.mark.parametrize("shard", [FIRST, LAST])
async def test_chunked_prefill_shares_steps_with_running_decodes(shard):
  engine = StepEngine(delay=0.005)
  s = scheduler(engine, shard=shard, batch_size=8, chunk=64, live={"d0", "d1", "d2"})  # running decodes come back
  prompt = np.arange(300).reshape(1, 300) if shard is FIRST else np.ones((1, 300, HIDDEN))

  running = [asyncio.Event() for _ in range(3)]

  async def decode(rid, running):
    for t in range(RUNNING_AFTER + 8):
      out, _ = await s.infer(rid, np.array([[t]]), None)
      assert out.tolist() == [[t + 1]]
      if t + 1 == RUNNING_AFTER:
        running.set()
    s.forget(rid)  # as the node's exo_request_ended hook does

  decodes = [asyncio.ensure_future(decode(f"d{i}", event)) for i, event in enumerate(running)]
  s.timeout_s = 1.0
  await asyncio.wait_for(asyncio.gather(*[event.wait() for event in running]), 5)  # the streams are running
  out, state = await asyncio.wait_for(s.infer("long", prompt, None), 10)
  await asyncio.gather(*decodes)
  long_steps = [shape for step in engine.steps for rid, shape in step if rid == "long"]
  assert [sh[1] for sh in long_steps] == [64, 64, 64, 64, 44]
  assert state == {"seen": 300}  # each chunk got the state the previous one returned
  if shard is FIRST:  # hidden states of every position go on to the next node
    assert out.shape == (1, 300) and (out == prompt + 1).all()
  else:  # the last shard's output is the final chunk's (only its last position is ever sampled)
    assert out.shape == (1, 44, HIDDEN)
  steps_with_long = [step for step in engine.steps if any(rid == "long" for rid, _ in step)]
  assert all(len(step) == 4 for step in steps_with_long[:3])  # the decodes kept running beside each chunk
  await s.stop()


async def test_at_most_one_chunk_budget_of_prompt_tokens_per_step_beside_a_running_stream():
  engine = StepEngine()
  s = scheduler(engine, batch_size=8, chunk=100, live={"d"})
  for t in range(RUNNING_AFTER):
    await s.infer("d", np.array([[t]]), None)  # d's stream is running, and it is away now
  await asyncio.gather(*[s.infer(f"p{i}", np.zeros((1, 70), dtype=np.int64), None) for i in range(3)])
  assert [[sh[1] for _, sh in step] for step in engine.steps[RUNNING_AFTER:]] == [[70, 30], [40, 60], [10]]
  await s.stop()


async def test_a_chunk_grows_with_the_decode_rows_beside_it():
  """Beside many running streams a step is long anyway: the prompt budget grows to 2 tokens per decode row."""
  engine = StepEngine()
  streams = [f"d{i}" for i in range(12)]
  s = scheduler(engine, batch_size=16, timeout_s=1.0, chunk=8, live=set(streams))

  async def stream(request_id, steps):
    for t in range(steps):
      await s.infer(request_id, np.array([[t]]), None)
  await asyncio.gather(*[stream(r, RUNNING_AFTER) for r in streams])  # all 12 are running now
  await asyncio.wait_for(asyncio.gather(*[stream(r, 3) for r in streams], s.infer("p", np.zeros((1, 60), dtype=np.int64), None)), 10)
  chunks = [(shape[1], len(step)) for step in engine.steps for rid, shape in step if rid == "p"]
  assert chunks == [(24, 13), (24, 13), (12, 13)], "2 x 12 decode rows: 24-token chunks, each beside all 12 streams"
  await s.stop()


async def test_prompts_are_not_cut_small_while_no_stream_is_running():
  """Chunks protect running streams; a prompt alone, or beside streams that have only just started (a burst),
  runs in steps of up to LONE_PROMPT_CHUNK."""
  engine = StepEngine()
  s = scheduler(engine, chunk=64, live={"d"})
  await s.infer("p", np.zeros((1, LONE_PROMPT_CHUNK + 88), dtype=np.int64), None)
  for t in range(RUNNING_AFTER - 1):
    await s.infer("d", np.array([[t]]), None)  # d has just started and is away
  await s.infer("q", np.zeros((1, 100), dtype=np.int64), None)
  await s.infer("d", np.array([[RUNNING_AFTER]]), None)  # now d's stream is running
  await s.infer("r", np.zeros((1, 100), dtype=np.int64), None)
  expected = [[LONE_PROMPT_CHUNK], [88]] + [[1]] * (RUNNING_AFTER - 1) + [[100], [1], [64], [36]]
  assert [[sh[1] for _, sh in step] for step in engine.steps] == expected
  s.forget("d")
  await s.infer("t", np.zeros((1, 100), dtype=np.int64), None)  # d ended: nobody to protect
  assert [sh[1] for _, sh in engine.steps[-1]] == [100]
  await s.stop()


async def test_a_failing_row_fails_alone_and_a_failing_step_fails_only_its_rows():
  engine = StepEngine(fail={"bad"}, fail_step=1)
  s = scheduler(engine, batch_size=4)
  first = await asyncio.gather(*[s.infer(rid, np.array([[1]]), None) for rid in ["a", "bad", "c"]], return_exceptions=True)
  assert isinstance(first[1], ValueError) and not isinstance(first[0], Exception) and not isinstance(first[2], Exception)
  second = await asyncio.gather(*[s.infer(rid, np.array([[1]]), None) for rid in ["a", "c"]], return_exceptions=True)
  assert all(isinstance(r, RuntimeError) for r in second)
  third = await s.infer("a", np.array([[1]]), None)
  assert third[0].tolist() == [[2]]
  await s.stop()


async def test_a_malformed_result_or_a_scheduler_bug_ends_requests_with_an_error_never_a_hang():
  class Malformed(StepEngine):
    async def infer_batch(self, shard, items):
      results = await super().infer_batch(shard, items)
      return ["not an (output, state) pair" if rid == "bad" else r for (rid, _, _), r in zip(items, results)]
  s = scheduler(Malformed())
  good, bad = await asyncio.wait_for(asyncio.gather(*[s.infer(rid, np.array([[1]]), None) for rid in ["good", "bad"]], return_exceptions=True), 5)
  assert good[0].tolist() == [[2]] and isinstance(bad, ValueError)

  def broken_pick():
    raise RuntimeError("a bug in picking the rows")
  s._pick = broken_pick
  with pytest.raises(RuntimeError, match="a bug in picking"):
    await asyncio.wait_for(s.infer("a", np.array([[1]]), None), 5)
  del s._pick  # the loop survived its bug: the next request runs
  assert (await asyncio.wait_for(s.infer("b", np.array([[1]]), None), 5))[0].tolist() == [[2]]
  await s.stop()


async def test_stop_lets_the_step_finish_and_fails_the_waiting():
  engine = StepEngine(delay=0.2)
  s = scheduler(engine, batch_size=2)
  running = [asyncio.ensure_future(s.infer(r, np.array([[1]]), None)) for r in "ab"]
  await asyncio.sleep(0.05)
  waiting = asyncio.ensure_future(s.infer("c", np.array([[1]]), None))
  await asyncio.sleep(0)
  await asyncio.wait_for(s.stop(), 5)
  assert [r.result()[0].tolist() for r in running] == [[[2]], [[2]]]
  with pytest.raises(BatcherStopped):
    await waiting
  with pytest.raises(BatcherStopped):
    await s.infer("d", np.array([[1]]), None)


async def test_prompts_are_chunked_through_a_node_and_outputs_still_match():
  from tests.support.toy import ask, reference_greedy
  engine = ToyEngine()
  node, plugin = make_node(engine, BatchingConfig(batch_size=6, timeout_ms=5, prefill_chunk=7))
  prompts = [f"a rather long prompt number {i} " * (i % 3 + 1) for i in range(10)]
  outs = await asyncio.wait_for(asyncio.gather(*[ask(node, p, SamplingParams(max_tokens=6), random.uniform(0, 0.03)) for p in prompts]), 60)
  assert outs == [reference_greedy(p, 6) for p in prompts]
  assert max(plugin.step_stats().sizes) > 1
  await settle(node)


# --- the real model ---

@pytest.fixture(scope="module")
def smollm2_engine(downloader):
  from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
  engine = NumpyDynamicShardInferenceEngine(downloader)
  asyncio.run(engine.ensure_shard(smollm2_shard()))
  return engine


async def test_smollm2_32_requests_at_random_times_match_unbatched(smollm2_engine):
  from exo.orchestration.generation import generate
  rng = random.Random(7)
  words = "sun river stone apple cloud music garden ocean paper window silver forest".split()
  jobs = [(f"Story {i}: " + " ".join(rng.choice(words) for _ in range(rng.choice([2, 10, 40, 90]))), rng.uniform(0, 1.0)) for i in range(32)]
  params = SamplingParams(max_tokens=5, ignore_eos=True)

  async def run(config):
    node, plugin = make_node(smollm2_engine, config)
    node.max_generate_tokens = 5

    async def one(prompt, delay):
      await asyncio.sleep(delay)
      out = []
      async for tokens, _ in generate(node, smollm2_shard(), prompt, params, timeout=300):
        out += tokens
      return out
    outs = await asyncio.wait_for(asyncio.gather(*[one(p, d) for p, d in jobs]), 280)
    await settle(node)
    return outs, plugin

  unbatched, _ = await run(None)
  batched, plugin = await run(BatchingConfig(batch_size=16, timeout_ms=5, prefill_chunk=32))
  assert batched == unbatched
  assert all(len(o) == 5 for o in batched)
  assert plugin.step_stats().mean > 2, plugin.step_stats()

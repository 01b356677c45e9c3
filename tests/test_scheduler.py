"""Continuous batching at one node. The Scheduler is a policy: what each step takes, which group of requests goes
when (micro-batches round a ring), chunked prefill, all on a fake clock with no engine and no waiting. The step loop
that drives it: per-request errors, acceptance, ending requests, stop. (On the real SmolLM2: test_batching_acceptance.py.)"""
import asyncio
import math
import random
from typing import List

import numpy as np
import pytest

from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.orchestration.steps.loop import BatcherStopped
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.steps.micro_batches import StageTimes, StepCost, best_groups
from exo.orchestration.steps.scheduler import GATHER_LIMIT, LONE_PROMPT_CHUNK, ROUND_TRIP_SLACK, RUNNING_AFTER, Scheduler
from exo.orchestration.steps import loop as step_loop_module
from exo.orchestration.steps.loop import StepLoop
from exo.orchestration.requests import RequestEnded
from tests.support.waiting import eventually
from tests.support.toy import ToyEngine, make_node, settle

pytestmark = pytest.mark.unit

FIRST, MIDDLE, LAST = Shard("toy", 0, 1, 6), Shard("toy", 2, 3, 6), Shard("toy", 4, 5, 6)
HIDDEN = 4
TOKEN = np.array([[7]])


def scheduler(shard=LAST, batch_size=8, timeout_s=0.0, chunk=0, stages=1) -> Scheduler:
  s = Scheduler(shard, batch_size, timeout_s, chunk)
  s.stages = s.groups = stages
  return s


def run(s: Scheduler, now: float, step_s: float = 0.0):
  """Schedule at `now`; if a step comes, finish it step_s later with output = input + 1. Returns the step's
  request ids (None: no step)."""
  step = s.schedule(now)
  if step is None:
    return None
  results = [(np.asarray(x) + 1, {"seen": (state or {}).get("seen", 0) + np.shape(x)[1]}) for _, x, state in step.items()]
  s.update(step, results, now + step_s)
  return [row.request_id for row, _ in step.rows]


def taken(s: Scheduler, now: float):
  """The positions each row of the step due now takes, finished at once."""
  step = s.schedule(now)
  takes = [take for _, take in step.rows]
  s.update(step, [(np.asarray(x) + 1, state) for _, x, state in step.items()], now)
  return takes


# --- one stage ---

def test_a_lone_request_never_waits():
  s = scheduler(timeout_s=30)
  s.add("a", TOKEN, None, 0.0)
  assert s.due(0.0) == 0.0 and run(s, 0.0) == ["a"]
  s.add("a", TOKEN, None, 1.0)  # it came back: nobody else is going, so again at once
  assert run(s, 1.0) == ["a"]


def test_ready_requests_share_a_step_up_to_the_batch_size_oldest_first():
  s = scheduler(batch_size=4)
  for i in range(10):
    s.add(f"r{i}", TOKEN, None, i * 0.001)
  assert [run(s, 1.0) for _ in range(3)] == [[f"r{i}" for i in range(4)], [f"r{i}" for i in range(4, 8)], ["r8", "r9"]]
  assert s.schedule(1.0) is None and s.due(1.0) == math.inf


def test_a_step_waits_for_requests_on_their_way_back_but_at_most_the_timeout():
  s = scheduler(shard=MIDDLE, timeout_s=1.0)
  for r in "abc":
    s.add(r, TOKEN, None, 0.0)
  assert run(s, 0.0) == ["a", "b", "c"]  # all three are away now
  s.add("a", TOKEN, None, 2.0)
  s.add("b", TOKEN, None, 2.5)
  assert s.schedule(2.9) is None and s.due(2.9) == 3.5  # c may still come: timeout_s after the latest arrival
  assert run(s, 3.5) == ["a", "b"]
  s.add("c", TOKEN, None, 3.6)  # late: a and b have just left again, a round trip (2.5 s) from coming back: c goes alone
  assert s.due(3.6) == 3.6 and run(s, 3.6) == ["c"]


def test_a_burst_whose_messages_keep_arriving_waits_at_most_gather_limit_timeouts():
  s = scheduler(shard=MIDDLE, batch_size=32, timeout_s=0.2)
  for i in range(13):
    s.add(f"r{i}", TOKEN, None, 0.0)
  run(s, 0.0)
  for i in range(12):  # 0.15 s apart: each within timeout_s of the previous, r12 never comes
    s.add(f"r{i}", TOKEN, None, 1.0 + 0.15 * i)
    if 1.0 + 0.15 * i < 1.0 + GATHER_LIMIT * 0.2:
      assert s.schedule(1.0 + 0.15 * i) is None
  assert s.due(3.0) == pytest.approx(1.0 + GATHER_LIMIT * 0.2)


def test_a_request_that_ended_holds_nobody_up():
  s = scheduler(shard=MIDDLE, timeout_s=30)
  for r in "ab":
    s.add(r, TOKEN, None, 0.0)
  run(s, 0.0)
  s.add("a", TOKEN, None, 1.0)
  assert s.schedule(1.0) is None  # b may come back
  s.drop("b")  # b ended (the node's exo_request_ended hook)
  assert run(s, 1.0) == ["a"]


def test_a_request_that_ended_during_its_step_is_not_handed_back():
  s = scheduler()
  for r in "ab":
    s.add(r, TOKEN, None, 0.0)
  step = s.schedule(0.0)
  s.drop("b")
  done = s.update(step, [(TOKEN + 1, None), (TOKEN + 1, None)], 0.1)
  assert [row.request_id for row, _ in done] == ["a"] and "b" not in s.away


# --- micro-batches round a ring ---

def test_the_first_layers_node_keeps_one_group_per_stage_in_flight():
  """Four requests, a ring of two stages: two groups of two. While one group is away the other steps; neither
  waits for the other."""
  s = scheduler(shard=FIRST, timeout_s=0.005, stages=2)
  for r in "abcd":
    s.add(r, np.zeros((1, 5), dtype=np.int64), None, 0.0)
  first = run(s, 0.0, step_s=0.1)
  second = run(s, 0.1, step_s=0.1)
  assert len(first) == len(second) == 2 and set(first) | set(second) == set("abcd")
  for r in first:  # the first group comes back while the second one is away
    s.add(r, TOKEN, None, 0.3)
  assert run(s, 0.3, step_s=0.1) == first
  for r in second:
    s.add(r, TOKEN, None, 0.4)
  assert run(s, 0.4, step_s=0.1) == second


def test_a_group_waits_for_its_late_member_up_to_the_slack_of_a_typical_round_trip():
  s = scheduler(shard=FIRST, timeout_s=0.005, stages=2)
  for r in "abcd":
    s.add(r, TOKEN, None, 0.0)
  groups = [run(s, 0.0, step_s=0.1), run(s, 0.1, step_s=0.1)]
  t = 0.2
  for _ in range(3):  # each group goes round in 0.2 s
    for group in groups:
      for r in group:
        s.add(r, TOKEN, None, t + 0.2)
      assert run(s, t + 0.2, step_s=0.1) == group
      t += 0.1
  late, on_time = groups[0]
  s.add(on_time, TOKEN, None, t + 0.2)
  left = max(s.away[late], 0)
  assert s.schedule(t + 0.25) is None  # well past timeout_s, but the late member is not overdue yet
  assert s.due(t + 0.25) == pytest.approx(left + ROUND_TRIP_SLACK * s.typical_round_trip())
  assert run(s, s.due(t + 0.25)) == [on_time]


def test_groups_stay_balanced_by_rows_as_requests_leave():
  s = scheduler(shard=FIRST, stages=2)
  for i in range(8):
    s.add(f"r{i}", TOKEN, None, 0.0)
  a, b = run(s, 0.0), run(s, 0.0)
  assert len(a) == len(b) == 4
  for r in a[:3]:
    s.drop(r)  # three of the first group finish
  for r in b:
    s.add(r, TOKEN, None, 1.0)
  moved = run(s, 1.0)
  assert len(moved) == 3 and set(moved) < set(b)  # one of the big group's members moved over to the small one
  sizes = sorted(list(s.group_of.values()).count(g) for g in range(2))
  assert sizes == [2, 3]


def test_newcomers_join_the_smallest_group():
  s = scheduler(shard=FIRST, stages=2)
  for i in range(3):
    s.add(f"r{i}", TOKEN, None, 0.0)
  run(s, 0.0)
  run(s, 0.0)
  sizes = {g: list(s.group_of.values()).count(g) for g in range(2)}
  s.add("new", np.zeros((1, 4), dtype=np.int64), None, 1.0)
  assert run(s, 1.0) == ["new"] and s.group_of["new"] == min(sizes, key=sizes.get)


def test_other_stages_gather_each_group_as_it_arrives_and_keep_groups_apart():
  """The stage after the first sees each group arrive as a burst of messages: it gathers the burst (timeout_s after
  the latest arrival), and the next group, a whole step later, goes in a step of its own."""
  s = scheduler(shard=LAST, timeout_s=0.05)
  for r in "ab":
    s.add(r, TOKEN, None, 0.0)
  assert run(s, 0.0) == ["a", "b"]
  s.add("c", TOKEN, None, 0.02)
  s.add("d", TOKEN, None, 0.06)
  assert s.schedule(0.1) is None and run(s, 0.11) == ["c", "d"]
  s.add("a", TOKEN, None, 1.0)
  s.add("b", TOKEN, None, 1.001)
  assert run(s, 1.051) == ["a", "b"]


def test_a_later_stage_waits_for_requests_due_back_but_not_for_a_micro_batch_that_just_left():
  s = scheduler(shard=LAST, timeout_s=0.05)
  for r in "abcd":
    s.add(r, TOKEN, None, 0.0)
  assert run(s, 0.0) == list("abcd")
  s.add("a", TOKEN, None, 0.2)
  s.add("b", TOKEN, None, 0.2)
  assert s.due(0.2) == 0.25  # c and d left with them, a round trip ago: due back any moment, worth the wait
  assert run(s, 0.25) == ["a", "b"]  # they did not come: a and b go alone, and the two pairs are a step apart
  s.add("c", TOKEN, None, 0.3)
  s.add("d", TOKEN, None, 0.3)
  # a and b left 0.05 s ago, a round trip (0.2 s) from coming back: waiting timeout_s would only delay c and d.
  assert s.due(0.3) == 0.3 and run(s, 0.3) == ["c", "d"]


def test_the_number_of_groups_follows_the_measured_step_costs_and_hops():
  even = [StepCost(0.030, 0.0035)] * 2  # two equal stages: reading the weights costs as much as 8.5 rows
  assert best_groups(32, even, hops_s=0.002) == 2
  assert best_groups(1, even, hops_s=0.002) == 1
  assert best_groups(32, even, hops_s=0.2) > 2  # a slow link: more groups fill it
  assert best_groups(32, [StepCost(0.030, 0.0035), StepCost(0.300, 0.0035)], hops_s=0.002) == 1  # one slow stage's weights decide
  times = StageTimes()
  for rows in (4, 8, 16, 8):
    times.record(0.0, 0.030 + 0.0035 * rows, rows, decode_only=True)
  cost = times.cost()
  assert cost.fixed_s == pytest.approx(0.030) and cost.per_row_s == pytest.approx(0.0035)


def test_the_first_layers_node_plans_its_groups_from_its_measurements():
  s = scheduler(shard=FIRST, batch_size=32, stages=2)
  for i in range(32):
    s.add(f"r{i}", TOKEN, None, 0.0)
  t = 0.0
  for size in (4, 8, 16, 8):  # steps of different sizes: a fit of 30 ms + 3.5 ms per row
    s.times.record(t, t + 0.030 + 0.0035 * size, size, decode_only=True)
  s.round_trips.extend([0.030 + 0.0035 * 16 + 0.002] * 4)  # the other stage's step for 16 rows, and 2 ms of links
  assert len(run(s, t, step_s=0.030 + 0.0035 * 16)) == 16 and s.groups == 2
  s.round_trips.clear()
  s.round_trips.extend([0.5] * 4)  # a slow link
  assert len(run(s, t, step_s=0.030 + 0.0035 * 16)) < 16 and s.groups > 2


def test_a_whole_model_stage_keeps_one_group_whatever_it_measures():
  s = scheduler(shard=Shard("toy", 0, 5, 6), batch_size=32, stages=1)
  for i in range(16):
    s.add(f"r{i}", TOKEN, None, 0.0)
  for size in (4, 8, 16, 8):  # the fit of the test above
    s.times.record(0.0, 0.030 + 0.0035 * size, size, decode_only=True)
  s.round_trips.extend([0.5] * 4)  # a slow way back (sampling, a busy host): two stages would split for it
  assert len(run(s, 0.0, step_s=0.030 + 0.0035 * 16)) == 16 and s.groups == 1


def test_busy_fraction_counts_steps_in_the_recent_window():
  times = StageTimes()
  times.record(0.0, 1.0, 4, True)
  times.record(2.0, 2.5, 4, True)
  assert times.busy_fraction(3.0) == pytest.approx(0.5) and times.busy_total_s == pytest.approx(1.5)
  assert times.busy_fraction(100.0) == 0.0


# --- chunked prefill ---

@pytest.mark.parametrize("shard", [FIRST, LAST])
def test_chunked_prefill_shares_steps_with_running_decodes(shard):
  s = scheduler(shard=shard, chunk=64)
  for t in range(RUNNING_AFTER):
    for r in ("d0", "d1", "d2"):
      s.add(r, TOKEN, None, t)
    run(s, t)
  prompt = np.arange(300).reshape(1, 300) if shard is FIRST else np.ones((1, 300, HIDDEN))
  s.add("long", prompt, None, 10.0)
  outputs, t = [], 10.0
  while "long" in s.ready:
    for r in ("d0", "d1", "d2"):
      if r not in s.ready:
        s.add(r, TOKEN, None, t)
    step = s.schedule(t)
    assert len(step.rows) == 4  # the decodes keep running beside each chunk
    results = [(np.asarray(x) + 1, {"seen": (state or {}).get("seen", 0) + np.shape(x)[1]}) for _, x, state in step.items()]
    outputs += [(row.request_id, result) for row, result in s.update(step, results, t)]
    t += 1
  assert [take for take in s.stats.sizes] and t - 10.0 == 5  # 64, 64, 64, 64, 44
  (out, state), = [result for r, result in outputs if r == "long"]
  assert state == {"seen": 300}  # each chunk got the state the previous one returned
  if shard is FIRST:  # hidden states of every position go on to the next node
    assert out.shape == (1, 300) and (out == prompt + 1).all()
  else:  # the last shard's output is the final chunk's (only its last position is ever sampled)
    assert out.shape == (1, 44, HIDDEN)


def test_at_most_one_chunk_budget_of_prompt_tokens_per_step_beside_a_running_stream():
  s = scheduler(chunk=100)
  for t in range(RUNNING_AFTER):
    s.add("d", TOKEN, None, t)
    run(s, t)  # d's stream is running, and it is away now
  for i in range(3):
    s.add(f"p{i}", np.zeros((1, 70), dtype=np.int64), None, 10.0)
  assert [taken(s, 10.0) for _ in range(3)] == [[70, 30], [40, 60], [10]]


def test_a_chunk_grows_with_the_decode_rows_beside_it():
  """Beside many running streams a step is long anyway: the prompt budget grows to 2 tokens per decode row."""
  s = scheduler(batch_size=16, chunk=8)
  streams = [f"d{i}" for i in range(12)]
  for t in range(RUNNING_AFTER):
    for r in streams:
      s.add(r, TOKEN, None, t)
    run(s, t)
  s.add("p", np.zeros((1, 60), dtype=np.int64), None, 10.0)
  chunks = []
  for t in range(3):
    for r in streams:
      s.add(r, TOKEN, None, 10.0 + t)
    step = s.schedule(10.0 + t)
    chunks += [(take, len(step.rows)) for row, take in step.rows if row.request_id == "p"]
    s.update(step, [(np.asarray(x) + 1, None) for _, x, _ in step.items()], 10.0 + t)
  assert chunks == [(24, 13), (24, 13), (12, 13)], "2 x 12 decode rows: 24-token chunks, each beside all 12 streams"


def test_prompts_are_not_cut_small_while_no_stream_is_running():
  """Chunks protect running streams; a prompt alone, or beside streams that have only just started (a burst),
  runs in steps of up to LONE_PROMPT_CHUNK."""
  s = scheduler(chunk=64)
  s.add("p", np.zeros((1, LONE_PROMPT_CHUNK + 88), dtype=np.int64), None, 0.0)
  assert [taken(s, 0.0), taken(s, 0.0)] == [[LONE_PROMPT_CHUNK], [88]]
  s.drop("p")
  for t in range(RUNNING_AFTER - 1):
    s.add("d", TOKEN, None, t)
    run(s, t)  # d has just started and is away
  s.add("q", np.zeros((1, 100), dtype=np.int64), None, 10.0)
  assert taken(s, 10.0) == [100]
  s.add("d", TOKEN, None, 11.0)
  run(s, 11.0)  # now d's stream is running
  s.add("r", np.zeros((1, 100), dtype=np.int64), None, 12.0)
  assert [taken(s, 12.0), taken(s, 12.0)] == [[64], [36]]
  s.drop("d")
  s.add("t", np.zeros((1, 100), dtype=np.int64), None, 13.0)
  assert taken(s, 13.0) == [100]  # d ended: nobody to protect


# --- the step loop ---

class StepEngine:
  """Records every step; output = input + 1; one error on request; steps held until released."""

  def __init__(self, fail=(), fail_step: int = -1, malformed=()):
    self.steps: List[List[str]] = []
    self.fail, self.fail_step, self.malformed = set(fail), fail_step, set(malformed)
    self.release = asyncio.Event()
    self.release.set()
    self.entered = asyncio.Event()

  async def infer_batch(self, shard, items):
    self.steps.append([rid for rid, _, _ in items])
    self.entered.set()
    await self.release.wait()
    if len(self.steps) - 1 == self.fail_step:
      raise RuntimeError("the whole step broke")
    return [ValueError(f"bad input for {rid}") if rid in self.fail else "not a pair" if rid in self.malformed else (np.asarray(x) + 1, state)
            for rid, x, state in items]


def step_loop(engine, batch_size=8, live=lambda request_id: True):
  return StepLoop(engine, lambda shard: Scheduler(shard, batch_size, 0.0, 0), live)


async def test_the_loop_runs_each_request_and_fails_only_the_bad_rows():
  engine = StepEngine(fail={"bad"}, malformed={"odd"})
  loop = step_loop(engine)
  results = await asyncio.wait_for(asyncio.gather(*[loop.infer(LAST, r, TOKEN, None) for r in ("a", "bad", "odd", "c")], return_exceptions=True), 5)
  assert results[0][0].tolist() == [[8]] and results[3][0].tolist() == [[8]]
  assert isinstance(results[1], ValueError) and isinstance(results[2], ValueError)
  engine.fail_step = len(engine.steps)
  with pytest.raises(RuntimeError, match="whole step"):
    await asyncio.wait_for(loop.infer(LAST, "a", TOKEN, None), 5)
  assert (await asyncio.wait_for(loop.infer(LAST, "a", TOKEN, None), 5))[0].tolist() == [[8]]  # the loop goes on
  await loop.stop()


async def test_a_message_is_accepted_when_its_step_starts_not_when_it_arrives():
  engine = StepEngine()
  engine.release.clear()
  loop = step_loop(engine, batch_size=1)
  accepted = {r: asyncio.get_running_loop().create_future() for r in "ab"}
  calls = [asyncio.ensure_future(loop.infer(LAST, r, TOKEN, None, accepted[r])) for r in "ab"]
  await asyncio.wait_for(engine.entered.wait(), 5)
  assert accepted["a"].done() and not accepted["b"].done()  # b waits in line: no reply yet
  engine.release.set()
  await asyncio.wait_for(asyncio.gather(*calls), 5)
  assert accepted["b"].done() and engine.steps == [["a"], ["b"]]
  await loop.stop()


async def test_a_row_reaches_a_sleeping_loops_engine_two_turns_of_the_event_loop_after_it_arrives():
  """Every message of a pipeline meets an idle loop (it sleeps while the other stages work): each turn of the event
  loop between the message and its engine call is time between tokens (an Event under wait_for took four)."""
  turns = 0

  class Counting(StepEngine):
    async def infer_batch(self, shard, items):
      self.turn_at_entry = turns + 1  # the turn under way: the ticks run so far, and this one
      return await super().infer_batch(shard, items)

  def tick() -> None:  # once a turn of the event loop, until the engine has been called
    nonlocal turns
    turns += 1
    if not engine.entered.is_set():
      asyncio.get_running_loop().call_soon(tick)
  engine = Counting()
  loop = step_loop(engine)
  await asyncio.wait_for(loop.infer(LAST, "a", TOKEN, None), 5)
  await eventually(lambda: loop._wake.asleep, timeout=5)  # nothing due: the loop sleeps
  engine.entered.clear()
  turns = 0
  call = asyncio.ensure_future(loop.infer(LAST, "b", TOKEN, None))
  asyncio.get_running_loop().call_soon(tick)
  await asyncio.wait_for(engine.entered.wait(), 5)
  assert engine.steps[-1] == ["b"]
  assert engine.turn_at_entry <= 2  # the call lines its row up and wakes the loop; the loop's next turn runs the step
  await asyncio.wait_for(call, 5)
  await loop.stop()


async def test_a_steps_output_is_sent_before_the_next_step_and_its_waiters_hear_none():
  """On one core a send that starts after the next step has begun waits on that step's pieces: the next stage gets
  its rows late. The step's finisher returns what sends its output; the loop hands its waiters None (their rows are
  done with), runs the send, and lets the send tasks it spawned start before the next engine call."""
  events: List[str] = []

  class Recording(StepEngine):
    async def infer_batch(self, shard, items):
      events.append(f"step {items[0][0]}")
      return await super().infer_batch(shard, items)

  async def send(request_id):
    events.append(f"send {request_id}")

  def finishing_for(scheduler, step):
    async def finish(done):
      finished = [row.request_id for row, _ in done]
      return lambda: [asyncio.ensure_future(send(r)) for r in finished]
    return finish

  loop = StepLoop(Recording(), lambda shard: Scheduler(shard, 1, 0.0, 0), finishing_for=finishing_for)
  results = await asyncio.wait_for(asyncio.gather(loop.infer(LAST, "a", TOKEN, None), loop.infer(LAST, "b", TOKEN, None)), 5)
  assert results == [None, None]
  assert events == ["step a", "send a", "step b", "send b"]
  await loop.stop()


async def test_a_steps_on_step_runs_once_the_next_step_has_the_engine_or_the_loop_goes_idle():
  """The bookkeeping after a step (on_step: the batching plugin's view of the ring) is not on the way from one step
  to the next: it runs while the next step's engine call runs, or, with no next step, before the loop sleeps."""
  events: List[str] = []

  class Recording(StepEngine):
    async def infer_batch(self, shard, items):
      events.append(f"step {items[0][0]}")
      if items[0][0] == "b":
        self.release.clear()
      return await super().infer_batch(shard, items)

  engine = Recording()
  loop = StepLoop(engine, lambda shard: Scheduler(shard, 1, 0.0, 0), on_step=lambda scheduler, step: events.append(f"on_step {step.rows[0][0].request_id}"))
  calls = asyncio.ensure_future(asyncio.gather(loop.infer(LAST, "a", TOKEN, None), loop.infer(LAST, "b", TOKEN, None)))
  await eventually(lambda: "on_step a" in events, timeout=5)
  assert events == ["step a", "step b", "on_step a"]  # b's step holds the engine meanwhile
  engine.release.set()
  await asyncio.wait_for(calls, 5)
  await eventually(lambda: loop._wake.asleep, timeout=5)
  assert events == ["step a", "step b", "on_step a", "on_step b"]
  await loop.stop()


async def test_rows_a_step_sends_back_to_this_node_share_the_next_step():
  """A ring of one sends each decode row back to itself, and the rows arrive one after the other. The loop waits for
  the rows it was told are coming (with no batch timeout to gather them by), so every step keeps both rows: here b
  comes back only once a is in line and the loop has looked whether to start its next step."""
  rounds = {"a": 0, "b": 0}
  a_in_line_b_awaited, all_rounds_done = asyncio.Event(), asyncio.Event()

  class Observed(StepEngine):
    @property
    def prefix_starts_queued(self):  # read each time the loop looks whether to start its next step
      if loop._coming == {"b"}:  # a is back, b still on its way: only the wait keeps the step from starting with a alone
        a_in_line_b_awaited.set()
      return 0

  engine = Observed()

  async def come_back(request_id):
    if request_id == "b" and rounds["b"] < 3:  # (after the last step neither comes back)
      await a_in_line_b_awaited.wait()
      a_in_line_b_awaited.clear()
    rounds[request_id] += 1
    if rounds == {"a": 4, "b": 4}:
      all_rounds_done.set()
    if rounds[request_id] < 4:
      await loop.infer(LAST, request_id, TOKEN, None)

  def finishing_for(scheduler, step):
    async def finish(done):
      ids = [row.request_id for row, _ in done]

      def send():
        loop.expect(ids)
        for request_id in ids:
          asyncio.ensure_future(come_back(request_id))
      return send
    return finish

  loop = StepLoop(engine, lambda shard: Scheduler(shard, 8, 0.0, 0), finishing_for=finishing_for)
  await asyncio.wait_for(asyncio.gather(loop.infer(LAST, "a", TOKEN, None), loop.infer(LAST, "b", TOKEN, None)), 5)
  await asyncio.wait_for(all_rounds_done.wait(), 5)
  assert [sorted(step) for step in engine.steps] == [["a", "b"]] * 4
  await loop.stop()


async def test_a_request_that_ends_leaves_at_once_and_one_that_ended_while_queued_never_runs():
  engine = StepEngine()
  engine.release.clear()
  live = {"a", "b", "c"}
  loop = step_loop(engine, batch_size=1, live=lambda r: r in live)
  calls = {r: asyncio.ensure_future(loop.infer(LAST, r, TOKEN, None)) for r in "abc"}
  await asyncio.wait_for(engine.entered.wait(), 5)
  loop.forget("b")  # ended while waiting: its waiter fails at once
  with pytest.raises(RequestEnded):
    await asyncio.wait_for(calls["b"], 5)
  live.discard("c")  # ended without the hook having run yet: dropped just before the engine call
  engine.release.set()
  await asyncio.wait_for(calls["a"], 5)
  with pytest.raises(RequestEnded):
    await asyncio.wait_for(calls["c"], 5)
  assert engine.steps == [["a"]]
  await loop.stop()


class LookupEngine(StepEngine):
  """A real engine queues a new prompt's prefix lookup behind the step under way and counts it in
  prefix_starts_queued; this one is told the count, and says when the step loop looks at it."""

  def __init__(self):
    super().__init__()
    self.queued, self.looked = 0, asyncio.Event()

  @property
  def prefix_starts_queued(self) -> int:
    self.looked.set()
    return self.queued


async def test_a_prompt_whose_prefix_lookup_waits_behind_a_step_joins_the_next_step(monkeypatch):
  monkeypatch.setattr(step_loop_module, "ARRIVAL_WAIT_S", 30.0)
  engine = LookupEngine()
  engine.release.clear()
  loop = step_loop(engine)
  first = asyncio.ensure_future(loop.infer(LAST, "a", TOKEN, None))
  await asyncio.wait_for(engine.entered.wait(), 5)
  engine.queued = 1  # b's lookup waits for the step
  engine.release.set()
  await asyncio.wait_for(first, 5)
  engine.release.clear()
  engine.looked.clear()
  again = asyncio.ensure_future(loop.infer(LAST, "a", TOKEN, None))  # a's next token wakes the loop...
  await asyncio.wait_for(engine.looked.wait(), 5)  # ...which looks at the lookups queued, before any step
  assert len(engine.steps) == 1
  engine.queued = 0
  late = asyncio.ensure_future(loop.infer(LAST, "b", TOKEN, None))
  engine.release.set()
  await asyncio.wait_for(asyncio.gather(again, late), 5)
  assert engine.steps == [["a"], ["a", "b"]]
  monkeypatch.setattr(step_loop_module, "ARRIVAL_WAIT_S", 0.01)
  engine.queued = 1  # a lookup that never ends (a load behind it): steps still run
  assert (await asyncio.wait_for(loop.infer(LAST, "c", TOKEN, None), 5))[0].tolist() == [[8]]
  await loop.stop()


async def test_stop_lets_the_step_finish_and_fails_the_waiting():
  engine = StepEngine()
  engine.release.clear()
  loop = step_loop(engine, batch_size=2)
  running = [asyncio.ensure_future(loop.infer(LAST, r, TOKEN, None)) for r in "ab"]
  await asyncio.wait_for(engine.entered.wait(), 5)
  waiting = asyncio.ensure_future(loop.infer(LAST, "c", TOKEN, None))
  await eventually(lambda: "c" in loop.schedulers[LAST].ready, 5)  # it is in line
  stopping = asyncio.ensure_future(loop.stop())
  engine.release.set()
  await asyncio.wait_for(stopping, 5)
  assert [r.result()[0].tolist() for r in running] == [[[8]], [[8]]]
  with pytest.raises(BatcherStopped):
    await waiting
  with pytest.raises(BatcherStopped):
    await loop.infer(LAST, "d", TOKEN, None)


async def test_prompts_are_chunked_through_a_node_and_outputs_still_match():
  from tests.support.toy import ask, reference_greedy
  engine = ToyEngine()
  node, plugin = make_node(engine, BatchingConfig(batch_size=6, timeout_ms=5, prefill_chunk=7))
  prompts = [f"a rather long prompt number {i} " * (i % 3 + 1) for i in range(10)]
  outs = await asyncio.wait_for(asyncio.gather(*[ask(node, p, SamplingParams(max_tokens=6), random.uniform(0, 0.03)) for p in prompts]), 60)
  assert outs == [reference_greedy(p, 6) for p in prompts]
  assert max(plugin.step_stats().sizes) > 1
  await settle(node)

"""Several chat models on one node (exo/orchestration/model_pool.py), with the dummy engine on a fake clock: each
model on its own engine, requests for two models served side by side, the least recently used idle model unloaded
when memory is short, a request that finds no room waiting in line (and ModelBusy after its wait), keep-alive
unloading, and the step loop taking turns between models. (On the real models, through the HTTP API:
test_several_models.py.)"""
import asyncio
import math

import numpy as np
import pytest

from exo.download.shard_download import NoopShardDownloader
from exo.inference.dummy_inference_engine import DummyInferenceEngine
from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.networking.discovery import NoDiscovery
from exo.orchestration.steps.scheduler import Scheduler
from exo.orchestration.steps.loop import StepLoop
from exo.orchestration.generation import generate
from exo.orchestration.model_gate import ModelBusy, gate_key
from exo.orchestration.model_pool import max_loaded_models
from exo.orchestration.node import Node
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit

# The dummy engine holds no weights; each model weighs its KV reserve (placement's figures): 720, 1,024 and 3,584 MiB.
SMALL, MEDIUM, LARGE = Shard("smollm2-135m", 0, 29, 30), Shard("llama-3.2-1b", 0, 15, 16), Shard("llama-3.2-3b", 0, 27, 28)
ROOM_FOR_MEDIUM_AND_LARGE_MB = 5000  # but not for all three


class FakeClock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


async def started_node(memory_mb: int = 64_000, engine=None) -> Node:
  node = Node("solo", None, engine or DummyInferenceEngine(), NoDiscovery(), NoopShardDownloader(), partitioning_strategy=RingMemoryWeightedPartitioningStrategy())
  node.memory_offered_mb = memory_mb
  await node.start()
  node.model_pool.clock = FakeClock()
  return node


async def answer(node: Node, shard: Shard, request_id: str, tokens: int = 3) -> list:
  out = []
  async for new, _ in generate(node, shard, "x", SamplingParams(max_tokens=tokens), request_id=request_id, timeout=30):
    out += new
  return out


def loaded(node: Node) -> list:
  return [row["model"] for row in node.model_pool.describe()]


async def hold(node: Node, holder: str, shard: Shard) -> None:
  """A request holding the gate for `shard` (as one does from its first work here to its end)."""
  node.model_pool.expect(shard)
  await node.model_gate.enter(holder, gate_key(shard))


async def test_two_models_are_served_side_by_side_each_on_its_own_engine_and_loaded_once():
  node = await started_node()
  try:
    await hold(node, "small-holder", SMALL)
    medium = await asyncio.wait_for(answer(node, MEDIUM, "m1"), 10)  # the small model's request holds it meanwhile: no wait
    assert len(medium) == 3 and loaded(node) == [SMALL.model_id, MEDIUM.model_id]
    engines = node.model_pool.engines
    assert engines[SMALL.model_id] is node.inference_engine and engines[MEDIUM.model_id] is not node.inference_engine
    assert type(engines[MEDIUM.model_id]) is DummyInferenceEngine and engines[MEDIUM.model_id].shard == MEDIUM
    node.model_gate.leave("small-holder")
    for i in range(3):  # alternating: nothing is loaded again
      await asyncio.gather(answer(node, SMALL, f"s{i}"), answer(node, MEDIUM, f"m{i + 2}"))
    assert node.model_pool.loads == 2 and node.inference_engine.shard == SMALL
    assert [r["requests"] for r in node.model_pool.describe()] == [0, 0]
  finally:
    await node.stop()


async def test_when_memory_is_short_the_least_recently_used_idle_model_is_unloaded_first():
  node = await started_node(ROOM_FOR_MEDIUM_AND_LARGE_MB)
  try:
    await answer(node, SMALL, "s1")
    await answer(node, MEDIUM, "m1")
    assert loaded(node) == [SMALL.model_id, MEDIUM.model_id]
    await answer(node, LARGE, "l1")  # all three would not fit: the small model, used longest ago, goes
    assert loaded(node) == [MEDIUM.model_id, LARGE.model_id] and node.model_pool.loads == 3
    await answer(node, MEDIUM, "m2")
    await answer(node, SMALL, "s2")  # now the large one is the least recently used
    assert loaded(node) == [MEDIUM.model_id, SMALL.model_id] and node.model_pool.loads == 4
    assert len(node.model_pool.all_engines()) == 2  # the engine an unloaded model leaves is used again
  finally:
    await node.stop()


async def test_the_limit_of_loaded_models_holds_whatever_the_memory():
  node = await started_node()
  node.model_pool.max_models = 2
  try:
    for shard, request_id in ((SMALL, "s"), (MEDIUM, "m"), (LARGE, "l")):
      await answer(node, shard, request_id)
    assert loaded(node) == [MEDIUM.model_id, LARGE.model_id]
  finally:
    await node.stop()


async def test_with_no_idle_model_to_unload_a_request_waits_in_line_and_those_behind_it_wait_too():
  node = await started_node(ROOM_FOR_MEDIUM_AND_LARGE_MB)
  gate = node.model_gate
  try:
    await hold(node, "small-1", SMALL)
    await hold(node, "medium-1", MEDIUM)
    large = asyncio.ensure_future(hold(node, "large-1", LARGE))
    small_later = asyncio.ensure_future(hold(node, "small-2", SMALL))  # its model is loaded, but it came after large-1
    await eventually(lambda: gate.in_line() == ["large-1", "small-2"], 5)
    gate.leave("small-1")  # the small model is idle now: unloaded for the large one
    await asyncio.wait_for(large, 5)
    assert loaded(node) == [MEDIUM.model_id, LARGE.model_id] and not small_later.done()
    gate.leave("large-1")
    await asyncio.wait_for(small_later, 5)  # the large model went, least recently used of the idle ones
    assert loaded(node) == [MEDIUM.model_id, SMALL.model_id]
    gate.wait_s = 0.05
    with pytest.raises(ModelBusy, match="serving llama-3.2-1b, smollm2-135m to 2 request"):
      await hold(node, "large-2", LARGE)
  finally:
    await node.stop()


async def test_an_idle_model_is_unloaded_after_its_keep_alive_or_as_its_request_asked():
  node = await started_node()
  pool, clock = node.model_pool, node.model_pool.clock
  try:
    await answer(node, SMALL, "s1")  # on the node's own engine: kept unless a request asks otherwise
    await answer(node, MEDIUM, "m1")
    clock.now += 299
    assert loaded(node) == [SMALL.model_id, MEDIUM.model_id]
    assert [r["expires_in_s"] for r in pool.describe()] == [None, pytest.approx(1)]
    await answer(node, MEDIUM, "m2")  # used again: its five minutes start afresh
    clock.now += 299
    assert loaded(node) == [SMALL.model_id, MEDIUM.model_id]
    clock.now += 1
    assert loaded(node) == [SMALL.model_id]
    await answer(node, MEDIUM, "m3")
    pool.keep(MEDIUM.model_id, math.inf, now=True)  # Ollama's keep_alive -1 for an idle model
    clock.now += 10 ** 6
    assert loaded(node) == [SMALL.model_id, MEDIUM.model_id] and [r["expires_in_s"] for r in pool.describe()] == [None, None]
    pool.keep(SMALL.model_id, 0)  # the next request for it asks it to go as soon as it ends
    await answer(node, SMALL, "s2")
    assert loaded(node) == [MEDIUM.model_id]
    pool.keep(MEDIUM.model_id, 0, now=True)  # an idle model told to go, goes
    assert loaded(node) == [] and pool.loads == 3
  finally:
    await node.stop()


async def test_other_layers_of_a_loaded_model_wait_for_its_requests_and_then_replace_it():
  node = await started_node()
  first_half = Shard(SMALL.model_id, 0, 14, 30)
  try:
    await hold(node, "whole", SMALL)
    await answer(node, MEDIUM, "m1")  # another model loads beside it
    half = asyncio.ensure_future(hold(node, "half", first_half))
    await eventually(lambda: node.model_gate.in_line() == ["half"], 5)
    node.model_gate.leave("whole")
    await asyncio.wait_for(half, 5)
    assert [(r["model"], r["layers"]) for r in node.model_pool.describe()] == [(MEDIUM.model_id, [0, 15]), (SMALL.model_id, [0, 14])]
  finally:
    await node.stop()


class SubclassedEngine(DummyInferenceEngine):
  """An engine class exo does not build by name (a test's or a plugin's): the node holds one model at a time."""


async def test_a_node_whose_engine_exo_cannot_build_again_holds_one_model_at_a_time():
  node = await started_node(engine=SubclassedEngine())
  try:
    await answer(node, SMALL, "s1")
    await answer(node, MEDIUM, "m1")
    assert loaded(node) == [MEDIUM.model_id] and node.model_pool.all_engines() == [node.inference_engine]
  finally:
    await node.stop()


def test_the_limit_of_loaded_models_is_a_whole_number_from_one():
  assert max_loaded_models(None, {}) == 3 and max_loaded_models(None, {"EXO_MAX_LOADED_MODELS": "1"}) == 1
  with pytest.raises(ValueError, match="EXO_MAX_LOADED_MODELS must be a whole number"):
    max_loaded_models(None, {"EXO_MAX_LOADED_MODELS": "0"})


class TwoModelEngine:
  """Records the model of every step. A step ends once every other request is back in line (or done), so the model the
  loop steps next never depends on how soon a caller got back."""

  def __init__(self, request_ids):
    self.steps = []
    self.away = set(request_ids)  # requests neither in line nor done
    self.returned = asyncio.Event()

  def back(self, request_id):
    """In line again (its caller has just asked for its next step), or done."""
    self.away.discard(request_id)
    self.returned.set()

  async def infer_batch(self, shard, items):
    ids = {rid for rid, _, _ in items}
    self.steps.append((shard.model_id, sorted(ids)))
    while self.away - ids:
      self.returned.clear()
      await self.returned.wait()
    self.away |= ids
    return [(np.asarray(x) + 1, state) for _, x, state in items]


async def test_the_step_loop_steps_one_model_at_a_time_taking_turns():
  """Two models, each with more rows ready than a step takes: the models take turns, a step never mixes them."""
  request_ids = [f"{shard.model_id}-{i}" for shard in (SMALL, MEDIUM) for i in range(2)]
  engine = TwoModelEngine(request_ids)
  loop = StepLoop(engine, lambda shard: Scheduler(shard, 1, 0.0, 0), engine_for=lambda shard: engine)

  async def passes(shard, request_id, n):
    for _ in range(n):
      engine.back(request_id)  # (infer puts the row in line before it first waits)
      await loop.infer(shard, request_id, np.array([[1]]), None)
    engine.back(request_id)
  await asyncio.wait_for(asyncio.gather(*[passes(shard, f"{shard.model_id}-{i}", 4) for shard in (SMALL, MEDIUM) for i in range(2)]), 5)
  await loop.stop()
  assert all(rows[0].startswith(model) for model, rows in engine.steps)
  assert [model for model, _ in engine.steps] == [SMALL.model_id, MEDIUM.model_id] * 8


def test_ollamas_keep_alive_on_a_chat_or_generate_request_is_read_as_seconds_and_a_bad_one_names_the_field():
  from exo.api.errors import BadRequest
  from exo.api.ollama.request import parse_chat, parse_generate
  chat = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}
  assert parse_chat({**chat, "keep_alive": "10m"}, "smollm2-135m", "NumpyDynamicShardInferenceEngine").keep_alive == 600
  assert parse_chat(chat, "smollm2-135m", "NumpyDynamicShardInferenceEngine").keep_alive is None
  assert parse_generate({"model": "smollm2-135m", "prompt": "", "keep_alive": -1}, "smollm2-135m", "NumpyDynamicShardInferenceEngine").keep_alive == math.inf
  with pytest.raises(BadRequest) as bad:
    parse_chat({**chat, "keep_alive": "soon"}, "smollm2-135m", "NumpyDynamicShardInferenceEngine")
  assert bad.value.param == "keep_alive"

"""A ring of one: the upstream request lifecycle, dummy-engine parity, EOS, limits, cleanup, errors."""
import asyncio
import json
from contextlib import aclosing

import numpy as np
import pytest

from exo.download.shard_download import NoopShardDownloader
from exo.inference.dummy_inference_engine import DummyInferenceEngine
from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.networking.discovery import NoDiscovery
from exo.orchestration.generation import GenerationError, generate
from exo.orchestration.node import Node
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit

DUMMY = Shard("dummy", 0, 0, 8)


async def make_node(engine=None, **kwargs) -> Node:
  node = Node("solo", None, engine or DummyInferenceEngine(), NoDiscovery(), NoopShardDownloader(),
              partitioning_strategy=RingMemoryWeightedPartitioningStrategy(), **kwargs)
  await node.start()
  return node


async def collect(node, shard, prompt, params=SamplingParams(), request_id=None):
  tokens, finished = [], []
  async with aclosing(generate(node, shard, prompt, params, request_id=request_id, timeout=30)) as stream:
    async for delta, is_finished in stream:
      tokens += delta
      finished.append(is_finished)
  return tokens, finished


async def test_dummy_engine_parity():
  node = await make_node()
  try:
    tokens, finished = await collect(node, DUMMY, "anything")
    assert tokens == [2, 3, 4, 5, 6, 7, 8, 9, 10, 69]
    assert finished == [False] * 9 + [True]
    assert await node.inference_engine.decode(DUMMY, tokens) == "dummy" * 10
    assert node.get_current_shard(DUMMY) == Shard("dummy", 0, 7, 8)
  finally:
    await node.stop()


async def test_on_token_sees_deltas_and_buffers_are_removed():
  node = await make_node()
  events = []
  node.on_token.register("test").on_next(lambda rid, tokens, fin: events.append((rid, tokens, fin)))
  try:
    await collect(node, DUMMY, "x", request_id="r1")
    assert [e[1] for e in events] == [[t] for t in [2, 3, 4, 5, 6, 7, 8, 9, 10, 69]]
    assert {e[0] for e in events} == {"r1"}
    assert node.buffered_token_output == {} and node.outstanding_requests == {} and len(node.requests) == 0
  finally:
    await node.stop()


@pytest.mark.parametrize("limit_kind", ["node", "request"])
async def test_length_limit(limit_kind):
  node = await make_node(max_generate_tokens=5 if limit_kind == "node" else 1000)
  try:
    params = SamplingParams(max_tokens=5) if limit_kind == "request" else SamplingParams()
    tokens, finished = await collect(node, DUMMY, "x", params)
    assert tokens == [2, 3, 4, 5, 6] and finished[-1] is True
  finally:
    await node.stop()


async def test_concurrent_dummy_requests_are_independent():
  node = await make_node()
  try:
    results = await asyncio.gather(*[collect(node, DUMMY, f"p{i}") for i in range(8)])
    assert all(tokens == [2, 3, 4, 5, 6, 7, 8, 9, 10, 69] for tokens, _ in results)
  finally:
    await node.stop()


async def test_leaving_early_cancels_generation():
  node = await make_node(max_generate_tokens=10**6)
  node.inference_engine.sample = lambda x, temp=0.0, top_p=1.0: _never_eos()
  try:
    async with aclosing(generate(node, DUMMY, "x", request_id="leave", timeout=30)) as stream:
      async for delta, _ in stream:
        break
    await eventually(lambda: "leave" not in node.outstanding_requests, 2)  # the ring stops within a few steps
  finally:
    await node.stop()


async def _never_eos():
  return np.array([5])


async def test_engine_error_ends_the_request_with_an_error():
  class Failing(DummyInferenceEngine):
    async def infer_tensor(self, request_id, shard, input_data, inference_state=None):
      if request_id == "bad" and input_data.reshape(-1)[0] >= 4:
        raise RuntimeError("boom")
      return await super().infer_tensor(request_id, shard, input_data, inference_state)

  node = await make_node(Failing())
  try:
    with pytest.raises(GenerationError, match="boom"):
      await collect(node, DUMMY, "x", request_id="bad")
    tokens, _ = await collect(node, DUMMY, "x")  # an error in one request leaves the node serving
    assert tokens == [2, 3, 4, 5, 6, 7, 8, 9, 10, 69]
  finally:
    await node.stop()


async def test_sampling_params_reach_the_last_node_through_opaque_status():
  node = await make_node()
  statuses = []
  node.on_opaque_status.register("test").on_next(lambda rid, s: statuses.append(json.loads(s)))
  try:
    await node.lifecycle.start_request("p1", SamplingParams(temperature=0.7, top_k=5, seed=3))
    assert node.requests.get("p1").params == SamplingParams(temperature=0.7, top_k=5, seed=3)
    assert statuses[-1]["type"] == "request_params"
  finally:
    await node.stop()


class RecordingPeer:
  """Stands in for a peer's gRPC handle (a ring of one has no real peers to receive results): records SendResults."""

  def __init__(self, peer_id: str):
    self.peer_id, self.results = peer_id, []

  def id(self) -> str:
    return self.peer_id

  async def send_result(self, request_id, result, is_finished):
    self.results.append((list(result), is_finished))

  async def send_opaque_status(self, request_id, status):
    pass


@pytest.mark.parametrize("origin", ["asker", None])
async def test_tokens_go_to_the_node_that_asked_and_the_end_to_every_node(origin):
  """Each token goes only to the request's origin; the last one goes to every peer (which ends the request there).
  Without a known origin (a request from an upstream node), every token goes to every peer, as upstream does."""
  node = await make_node()
  asker, bystander = RecordingPeer("asker"), RecordingPeer("bystander")
  node.peers = [asker, bystander]
  done = asyncio.Event()
  node.on_token.register("test").on_next(lambda rid, tokens, fin: fin and done.set())
  try:
    status = {"type": "request_params", "request_id": "r1", "params": SamplingParams(max_tokens=3).to_dict()}
    node.receive_status("r1", json.dumps({**status, "origin": origin} if origin else status))
    await node.process_prompt(DUMMY, "x", request_id="r1")
    await asyncio.wait_for(done.wait(), 10)
    await eventually(lambda: node.pending()["tasks"] == 0, 5)  # the detached SendResult tasks
    every_token = [([2], False), ([3], False), ([4], True)]
    assert asker.results == every_token
    assert bystander.results == (every_token[-1:] if origin else every_token)
  finally:
    node.peers = []
    await node.stop()


async def test_stop_frees_the_cache_of_a_request_that_just_ended():
  class Releasing(DummyInferenceEngine):
    def __init__(self):
      super().__init__()
      self.released = []

    async def finish_request(self, request_id):
      await asyncio.sleep(0.05)  # a real engine hops to its worker thread
      self.released.append(request_id)

  engine = Releasing()
  node = await make_node(engine)
  await collect(node, DUMMY, "x", request_id="r1")
  await node.stop()  # at once: the release of r1's cache may not have run yet
  assert engine.released == ["r1"]


async def test_stop_leaves_no_task_behind():
  node = await make_node(max_generate_tokens=10**6)
  node.inference_engine.sample = lambda x, temp=0.0, top_p=1.0: _never_eos()
  stream = generate(node, DUMMY, "x", timeout=30)
  await stream.__anext__()
  await node.stop()
  assert node.pending()["tasks"] == 0 and node.outstanding_requests == {}
  with pytest.raises(GenerationError, match="node stopped"):
    async for _ in stream:
      pass

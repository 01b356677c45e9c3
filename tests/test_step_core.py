"""The step core on a real Node with the toy engine: a step's rows become one output (rows packed per next hop,
tokens per origin, the finished and the failed), sent as one message per hop and one per origin; a packed message
enters the next stage as one batch (no gathering wait); an upstream node's single message is a batch of one; and a
node without batching (or with batch size 1) takes the same path.

The peers here are recording stand-ins for the gRPC client (a PeerHandle that keeps what it is sent): the wire itself
is covered by the cluster tests (tests/test_placement_ring.py packs a pipeline's rows over real gRPC)."""
import asyncio
import json
from typing import List

import numpy as np
import pytest

from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.orchestration import statuses
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.routing.packing import ROWS, pack
from exo.orchestration.routing.route import Route
from exo.orchestration.steps.core import StepCore
from exo.topology.placement import Stage
from tests.support.toy import TOY, ToyEngine, ask, make_node, reference_greedy, settle, toy_logits
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit

LAST = Shard(TOY.model_id, 2, 3, TOY.n_layers)  # this node's layers on the routes below: the last ones


class RecordingPeer:
  """Stands for a peer's gRPC client: keeps every tensor and status it is sent."""

  def __init__(self, node_id: str):
    self.node_id, self.tensors, self.statuses = node_id, [], []

  def id(self) -> str:
    return self.node_id

  async def send_tensor(self, shard, tensor, request_id=None, inference_state=None):
    self.tensors.append((shard, np.asarray(tensor), request_id, inference_state))

  async def send_opaque_status(self, request_id, status):
    self.statuses.append(json.loads(status))

  async def send_result(self, request_id, result, is_finished):
    pass


def token_rows(peer: RecordingPeer) -> List[list]:
  return [row for status in peer.statuses if status["type"] == statuses.TOKENS for row in status["rows"]]


def routed_node(config=None):
  node, _ = make_node(ToyEngine(step_s=0, sample_s=0), config)
  peers = {name: RecordingPeer(name) for name in ("p1", "p2", "o1", "o2")}
  node.peers = list(peers.values())
  return node, peers


def route(first: str, origin: str, node) -> Route:
  return Route((Stage(first, 0, 1), Stage(node.id, 2, 3)), "v1", origin)


async def test_a_steps_output_packs_rows_per_next_hop_and_tokens_per_origin():
  node, peers = routed_node()
  a, b = route("p1", "o1", node), route("p2", "o2", node)
  for request_id, r, max_tokens in (("r1", a, 10), ("r2", a, 10), ("r3", b, 10), ("r4", b, 1)):
    node.forwarding.set_route(node.requests.open(request_id, SamplingParams(max_tokens=max_tokens)), r)
  rows = [(request_id, 1, toy_logits([1])[None], {"route": r.json}) for request_id, r in (("r1", a), ("r2", a), ("r3", b), ("r4", b))]
  output = await node.step_core.finish_step(LAST, rows, sampled={"r1": 5, "r2": 6, "r3": 7, "r4": 8})

  assert sorted((hop.to.node_id, [row[0] for row in hop.rows]) for hop in output.hops.values()) == [("p1", ["r1", "r2"]), ("p2", ["r3"])]
  assert [(t.request.origin, t.request.id, t.token) for t in output.tokens] == [("o1", "r1", 5), ("o1", "r2", 6), ("o2", "r3", 7), ("o2", "r4", 8)]
  assert output.finished == ["r4"] and output.failed == []

  node.forwarding.send(output)
  await eventually(lambda: peers["p1"].tensors and peers["p2"].tensors and token_rows(peers["o1"]) and token_rows(peers["o2"]), 5)
  (shard, tensor, _, state), = peers["p1"].tensors  # one message for both rows bound to p1
  assert shard == Shard(TOY.model_id, 0, 1, TOY.n_layers) and tensor.tolist() == [[5, 6]]
  assert [row[:2] for row in state[ROWS]] == [["r1", 1], ["r2", 1]]
  # A lone row goes packed too: the next stage knows it has the whole step, and need not wait for more.
  assert len(peers["p2"].tensors) == 1 and [row[0] for row in peers["p2"].tensors[0][3][ROWS]] == ["r3"]
  assert len([s for s in peers["o1"].statuses if s["type"] == statuses.TOKENS]) == 1 and token_rows(peers["o1"]) == [["r1", [5], False, None], ["r2", [6], False, None]]
  assert token_rows(peers["o2"]) == [["r3", [7], False, None], ["r4", [8], True, None]]
  assert ["r4", [8], True, None] in token_rows(peers["p2"])  # the last token also ends it on its route
  assert not node.requests.is_live("r4") and node.requests.is_live("r1")


class TokenRowsPeer(RecordingPeer):
  """A peer whose client has its own call for a step's token rows (as GRPCPeerHandle.send_token_rows)."""

  def __init__(self, node_id: str):
    super().__init__(node_id)
    self.token_calls = 0

  async def send_token_rows(self, status):
    self.token_calls += 1
    self.statuses.append(json.loads(status))


async def test_a_steps_tokens_go_by_the_peers_own_call_for_token_rows_where_it_has_one():
  node, peers = routed_node()
  node.peers = [TokenRowsPeer("o1") if p.id() == "o1" else p for p in node.peers]  # o2 keeps only send_opaque_status
  origin = node.peers[[p.id() for p in node.peers].index("o1")]
  a, b = route("p1", "o1", node), route("p1", "o2", node)
  for request_id, r in (("r1", a), ("r2", a), ("r3", b)):
    node.forwarding.set_route(node.requests.open(request_id, SamplingParams(max_tokens=10)), r)
  rows = [(request_id, 1, toy_logits([1])[None], {"route": r.json}) for request_id, r in (("r1", a), ("r2", a), ("r3", b))]
  node.forwarding.send(await node.step_core.finish_step(LAST, rows, sampled={"r1": 5, "r2": 6, "r3": 7}))
  await eventually(lambda: token_rows(origin) and token_rows(peers["o2"]), 5)
  assert origin.token_calls == 1 and token_rows(origin) == [["r1", [5], False, None], ["r2", [6], False, None]]  # one call, both rows
  assert token_rows(peers["o2"]) == [["r3", [7], False, None]]  # a peer without it: a status as any other


async def test_a_row_that_fails_to_sample_fails_alone():
  node, peers = routed_node()
  a = route("p1", "o1", node)
  for request_id in ("ok", "bad"):
    node.forwarding.set_route(node.requests.open(request_id, SamplingParams(max_tokens=10)), a)
  rows = [(request_id, 1, toy_logits([1])[None], {"route": a.json}) for request_id in ("ok", "bad")]
  output = await node.step_core.finish_step(LAST, rows, sampled={"ok": 5, "bad": ValueError("no token")})
  assert [row[0] for hop in output.hops.values() for row in hop.rows] == ["ok"]
  assert [(request_id, str(e)) for request_id, e in output.failed] == [("bad", "no token")]


async def test_a_packed_message_enters_the_next_stage_as_one_batch():
  # A batch timeout of a minute: a step that gathered by timeout would not come within the test's wait.
  node, peers = routed_node(BatchingConfig(batch_size=8, timeout_ms=60_000))
  a = route("p1", "o1", node)
  params = SamplingParams(max_tokens=5).to_dict()
  # A request handed on by an earlier step and still going round the ring: gathering would wait for it to come back.
  await asyncio.wait_for(node.process_tensor(TOY, np.array([[9]]), "early", {"route": a.json, "params": params}), 10)
  tensor, state = pack([(f"r{i}", np.array([[10 + i]]), {"route": a.json, "params": params}) for i in range(3)])
  await asyncio.wait_for(node.process_tensor(TOY, tensor, "r0", state), 10)
  assert node.inference_engine.batches == [1, 3]  # one engine step for the message's three rows, at once
  await eventually(lambda: len(peers["p1"].tensors) == 2 and len(token_rows(peers["o1"])) == 4, 5)
  assert len(peers["p1"].tensors[1][3][ROWS]) == 3  # on as one message
  assert [row[0] for row in token_rows(peers["o1"])] == ["early", "r0", "r1", "r2"]
  assert len([s for s in peers["o1"].statuses if s["type"] == statuses.TOKENS]) == 2  # one message per step
  await node.steps.stop()


async def test_an_upstream_nodes_single_message_is_a_batch_of_one():
  # No route in its state: a ring route, as upstream nodes send (here a ring of one: this node holds every layer).
  node, _ = make_node(ToyEngine(step_s=0, sample_s=0), BatchingConfig(batch_size=8, timeout_ms=60_000), max_generate_tokens=3)
  heard: List[int] = []
  node.on_token.register("test").on_next(lambda request_id, tokens, finished: heard.extend(tokens))
  await asyncio.wait_for(node.process_tensor(TOY, np.array([[9]]), "u1", None), 10)
  await eventually(lambda: not node.requests.is_live("u1"), 10)
  assert node.inference_engine.batches == [1, 1, 1]  # each of its passes a step of one, at once
  expected, history = [], [9]
  for _ in range(3):
    expected.append(int(np.argmax(toy_logits(history))))
    history.append(expected[-1])
  assert heard == expected
  await node.steps.stop()


@pytest.mark.parametrize("config", [None, BatchingConfig(batch_size=1, timeout_ms=5), BatchingConfig(batch_size=8, timeout_ms=5)],
                         ids=["no plugin", "batch size 1", "batch size 8"])
async def test_every_batch_size_takes_the_same_step_core(config, monkeypatch):
  added = []
  add = StepCore._add

  async def counting(self, output, shard, result, request_id, state):
    added.append(request_id)
    return await add(self, output, shard, result, request_id, state)
  monkeypatch.setattr(StepCore, "_add", counting)
  node, _ = make_node(ToyEngine(), config)
  answers = await asyncio.gather(*[ask(node, p, SamplingParams(max_tokens=4)) for p in ("one", "two")])
  assert answers == [reference_greedy(p, 4) for p in ("one", "two")]
  assert len(added) == sum(len(a) for a in answers)  # every token went through StepCore._add
  if config is None or config.batch_size == 1:  # through the step loop too: engine steps of one row each
    assert set(node.inference_engine.batches) == {1}
  await settle(node)

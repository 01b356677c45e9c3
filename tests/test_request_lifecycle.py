"""One life per request, at one node: the record only moves forward, an end is final and drops every later message,
a request for another model waits for the loaded one's requests instead of wiping them, peers cannot grow the node's
tables or end requests they are not part of, and a token wakes only its own request's client. (The same on the real
SmolLM2, through the HTTP API: test_lifecycle_on_smollm2.py.)"""
import asyncio
import json
import time

import numpy as np
import pytest

from exo.download.shard_download import NoopShardDownloader
from exo.inference.dummy_inference_engine import DummyInferenceEngine
from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.networking.discovery import NoDiscovery
from exo.orchestration import requests as registry_module
from exo.orchestration import statuses
from exo.orchestration.generation import generate
from exo.orchestration.model_gate import LeftTheLine, ModelBusy, ModelGate
from exo.orchestration.node import Node
from exo.orchestration.routing.route import Route
from exo.orchestration.requests import QUEUED_KEPT, QUEUED_KEPT_S, RequestRegistry, Status
from exo.topology.device_capabilities import DeviceCapabilities
from exo.topology.placement import Stage
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit

DUMMY = Shard("dummy", 0, 0, 8)


def make_node(node_id: str = "solo") -> Node:
  return Node(node_id, None, DummyInferenceEngine(), NoDiscovery(), NoopShardDownloader(), partitioning_strategy=RingMemoryWeightedPartitioningStrategy())


async def answer(node: Node, request_id: str, params: SamplingParams = SamplingParams()) -> list:
  out = []
  async for tokens, _ in generate(node, DUMMY, "x", params, request_id=request_id, timeout=30):
    out += tokens
  return out


# --- the record ---

def test_a_record_only_moves_forward_and_an_end_is_final():
  registry = RequestRegistry()
  request = registry.open("r")
  request.advance(Status.DECODING)
  request.advance(Status.PREFILLING)
  assert request.status is Status.DECODING
  assert registry.end("r", Status.CANCELLED) is request and request.status is Status.CANCELLED
  request.advance(Status.DECODING)
  assert request.status is Status.CANCELLED
  assert registry.open("r") is None and registry.ended("r") is Status.CANCELLED  # a late message cannot revive it
  assert registry.end("r", Status.FAILED) is None and registry.ended("r") is Status.CANCELLED


def test_ended_ids_are_forgotten_after_their_time(monkeypatch):
  registry = RequestRegistry()
  registry.end("old", Status.FINISHED)
  registry.sweep(time.monotonic() + registry_module.ENDED_KEPT_S + 1)
  assert registry.ended("old") is None


# --- the model gate ---

async def test_the_gate_lets_another_model_in_only_when_the_loaded_ones_requests_have_ended():
  gate = ModelGate()
  await gate.enter("a1", "A")
  switch = asyncio.ensure_future(gate.enter("b1", "B"))
  later_a = asyncio.ensure_future(gate.enter("a2", "A"))  # arrives after b1: waits behind it, so B is not starved
  await eventually(lambda: gate.in_line() == ["b1", "a2"], 5)
  gate.leave("a1")
  await switch
  assert gate.serving == "B" and not later_a.done()
  gate.leave("b1")
  await later_a
  assert gate.serving == "A" and set(gate.model_of) == {"a2"}


async def test_a_request_that_waits_too_long_for_the_gate_gets_a_clear_error_and_one_that_ends_leaves_the_line():
  gate = ModelGate(wait_s=0.05)
  await gate.enter("a1", "A")
  with pytest.raises(ModelBusy, match="serving A to 1 request"):
    await gate.enter("b1", "B")
  gate.wait_s = 60
  waiting = asyncio.ensure_future(gate.enter("b2", "B"))
  await eventually(lambda: gate.in_line() == ["b2"], 5)
  gate.leave("b2")  # it ended (cancelled) while in line
  with pytest.raises(LeftTheLine):
    await waiting
  gate.leave("a1")
  assert gate.idle_for("B")


async def test_a_request_for_other_layers_would_wait_only_behind_a_preload_never_behind_a_request():
  gate = ModelGate()
  assert gate.hold_if_idle("preload-1", "A")
  assert gate.no_request_disturbed_by("B") and not gate.idle_for("B")  # a route may still name B: it waits for the load
  first = asyncio.ensure_future(gate.enter("b1", "B"))
  await eventually(lambda: gate.in_line() == ["b1"], 5)
  assert gate.no_request_disturbed_by("B") and not gate.no_request_disturbed_by("C")  # C would wait for b1 too
  gate.leave("preload-1")
  await first
  gate.leave("b1")
  await gate.enter("r1", "A")
  assert gate.no_request_disturbed_by("A") and not gate.no_request_disturbed_by("B")


class OnCue:
  """Something that starts (`started` is set) and then waits until the test gives its cue."""

  def __init__(self):
    self.started, self.cue = asyncio.Event(), asyncio.Event()

  async def wait(self):
    self.started.set()
    await self.cue.wait()


class DownloadOnCue(NoopShardDownloader):
  def __init__(self):
    super().__init__()
    self.download = OnCue()

  async def ensure_shard(self, shard: Shard, inference_engine_name: str):
    await self.download.wait()
    return await super().ensure_shard(shard, inference_engine_name)


class LoadOnCue(DummyInferenceEngine):
  def __init__(self, slow_model: str):
    super().__init__()
    self.slow_model, self.load = slow_model, OnCue()

  async def ensure_shard(self, shard: Shard):
    if shard.model_id == self.slow_model and self.shard != shard:
      await self.load.wait()
    self.shard = shard


async def test_a_preload_holds_the_gate_while_it_loads_but_not_while_it_downloads():
  """A peer's prompt makes an idle node preload its model. While the files download, requests for the loaded model
  still start; a request for another model that arrives during the load itself waits for it, or the load would
  replace its model before its first step."""
  engine, downloader = LoadOnCue("llama-3.2-1b"), DownloadOnCue()
  node = Node("solo", None, engine, NoDiscovery(), downloader, partitioning_strategy=RingMemoryWeightedPartitioningStrategy())
  await node.start()
  try:
    peer_prompt = {"type": "node_status", "node_id": "a-peer", "status": "start_process_prompt", "request_id": "elsewhere",
                   "shard": Shard("llama-3.2-1b", 0, 15, 16).to_dict()}
    node.on_node_status("elsewhere", json.dumps(peer_prompt))  # a peer starts a prompt for llama-3.2-1b: this idle node preloads it
    await asyncio.wait_for(downloader.download.started.wait(), 5)
    await asyncio.wait_for(node.model_gate.enter("during-download", DUMMY.model_id), 1)  # admitted at once
    node.model_gate.leave("during-download")
    downloader.download.cue.set()
    await engine.load.started.wait()
    assert not node.model_gate.idle_for(DUMMY.model_id) and node.model_gate.serving == "llama-3.2-1b"  # enter waits
    request = asyncio.ensure_future(node.model_gate.enter("r", DUMMY.model_id))
    engine.load.cue.set()
    await request  # let in once the preload has loaded its model and left the gate
    assert node.model_gate.serving == DUMMY.model_id and set(node.model_gate.model_of) == {"r"}
    assert not node.model_gate.hold_if_idle("another-preload", "llama-3.2-1b")  # and none starts while "r" holds it
  finally:
    await node.stop()


class RecordingEngine(DummyInferenceEngine):
  def __init__(self):
    super().__init__()
    self.passes = []

  async def infer_tensor(self, request_id, shard, input_data, inference_state=None):
    self.passes.append((request_id, shard.model_id))
    return await super().infer_tensor(request_id, shard, input_data, inference_state)


def run_until_it_waits(coro) -> asyncio.Future:
  """Run `coro` here and now up to its first wait on a future (no scheduling in between); a task goes on from there."""
  async def rest(waiting):
    while True:
      if waiting is not None:
        await asyncio.wait([waiting])
      try:
        waiting = coro.send(None)
      except StopIteration as stop:
        return stop.value
  try:
    waiting = coro.send(None)
  except StopIteration as stop:
    done = asyncio.get_running_loop().create_future()
    done.set_result(stop.value)
    return done
  return asyncio.ensure_future(rest(waiting))


async def test_every_message_of_a_request_waits_for_its_turn_at_the_gate():
  """While a request waits for the gate (another model is being served), a second message of it (a resend, a
  peer's duplicate) must wait too: run at once, it would load its model under the requests that hold the gate."""
  engine = RecordingEngine()
  node = Node("solo", None, engine, NoDiscovery(), NoopShardDownloader(), partitioning_strategy=RingMemoryWeightedPartitioningStrategy())
  await node.start()
  try:
    await node.model_gate.enter("holder", "another-model")
    first = asyncio.ensure_future(node.process_tensor(DUMMY, np.array([[1]]), "r"))
    await eventually(lambda: node.requests.get("r") is not None and node.requests.get("r").model is not None)  # in line
    second = run_until_it_waits(node.process_tensor(DUMMY, np.array([[2]]), "r"))  # as far as it goes now
    assert engine.passes == [] and not first.done() and not second.done()
    node.model_gate.leave("holder")
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert engine.passes and all(p == ("r", DUMMY.model_id) for p in engine.passes)
  finally:
    await node.stop()


# --- one node, the dummy engine ---

async def test_a_second_prompt_for_a_live_or_ended_request_is_refused():
  node = make_node()
  await node.start()
  try:
    assert await answer(node, "once") == [2, 3, 4, 5, 6, 7, 8, 9, 10, 69]
    with pytest.raises(ValueError, match="already finished"):
      await node.process_prompt(DUMMY, "again", request_id="once")
    assert len(node.requests) == 0
    node.requests.open("live").advance(Status.DECODING)
    with pytest.raises(ValueError, match="already has its prompt"):
      await node.process_prompt(DUMMY, "again", request_id="live")
  finally:
    await node.stop()


async def test_a_token_wakes_only_its_own_requests_client():
  """Clients wait on their own request's queue: nothing is registered on on_token per request, so N streams cost
  N wake-ups per round, not N * N."""
  node = make_node()
  await node.start()
  seen = []
  node.on_token.register("observer").on_next(lambda rid, tokens, finished: seen.append(len(node.on_token.callbacks)))
  try:
    answers = await asyncio.gather(*[answer(node, f"r{i}") for i in range(20)])
    assert all(a == [2, 3, 4, 5, 6, 7, 8, 9, 10, 69] for a in answers)
    assert seen and set(seen) == {1}  # only the observer, never a callback per request
    assert node.pending()["watchers"] == 0
  finally:
    await node.stop()


async def test_peers_cannot_grow_the_nodes_tables():
  node = make_node()
  for i in range(20_000):
    node.receive_status(f"p{i}", json.dumps({"type": "request_params", "request_id": f"p{i}", "params": {"temperature": 0.5}, "origin": "x"}))
  assert len(node.requests) <= QUEUED_KEPT
  assert node.requests.get("p19999") is not None and node.requests.get("p0") is None  # the oldest went first
  node.lifecycle.forget_stale(time.monotonic() + QUEUED_KEPT_S + 1)
  assert len(node.requests) == 0
  for i in range(100):
    node.receive_status("", json.dumps({"type": "supported_inference_engines", "node_id": f"stranger{i}", "engines": ["numpy"]}))
    node.receive_status("", json.dumps({"type": "download_progress", "node_id": f"stranger{i}", "progress": {}}))
  assert node.get_topology_inference_engines() == [] and node.node_download_progress == {}


@pytest.mark.parametrize("status", [{"type": "request_params", "request_id": "m", "params": []}, {"type": "node_status", "status": 5},
                                    {"type": "request_params", "request_id": "m", "params": {"temperature": "hot"}},
                                    {"type": "cancel_request"}, "[1, 2", {"type": "node_status", "node_id": "n", "status": "start_process_prompt", "shard": [1]},
                                    {"type": "stage_timing", "node_id": "n", "shard": {"model_id": "m", "start_layer": 0, "end_layer": 1, "n_layers": 2},
                                     "fixed_s": -1.0, "per_row_s": 0.001, "busy": 0.5}])
def test_an_invalid_status_is_dropped_with_one_log_line_and_the_next_one_still_works(status, caplog):
  node = make_node()
  observed = []
  node.on_opaque_status.register("observer").on_next(lambda rid, raw: observed.append(raw))
  node.receive_status("m", status if isinstance(status, str) else json.dumps(status), "10.0.0.9")
  assert observed == [] and len(node.requests) == 0
  assert caplog.text.count("dropped an invalid status from 10.0.0.9") == 1
  good = json.dumps({"type": "request_params", "request_id": "m", "params": {"temperature": 0.5}})
  node.receive_status("m", good)
  assert observed == [good] and node.requests.get("m").params.temperature == 0.5


def caps(memory: int) -> DeviceCapabilities:
  return DeviceCapabilities(model="test", chip="test", memory=memory, flops={"fp32": 0, "fp16": 0, "int8": 0})


class PeerStandIn:
  """A peer's handle (this test needs a peer that refuses prompts, and another at a known address)."""

  def __init__(self, peer_id: str, host: str, fail: bool = False):
    self.peer_id, self.host, self.fail, self.statuses = peer_id, host, fail, []

  def id(self):
    return self.peer_id

  def addr(self):
    return f"{self.host}:5678"

  async def send_prompt(self, shard, prompt, request_id=None, inference_state=None):
    if self.fail:
      raise ConnectionError("connection refused")

  async def send_opaque_status(self, request_id, status):
    self.statuses.append(json.loads(status))

  async def send_result(self, request_id, result, is_finished):
    pass


def two_node_view(node: Node, first: PeerStandIn, other: PeerStandIn) -> None:
  node.peers = [first, other]
  node.peer_hosts = {first.id(): {first.host}, other.id(): {other.host}}
  for node_id, memory in ((node.id, 1000), (first.id(), 3000), (other.id(), 500)):
    node.topology.update_node(node_id, caps(memory))


async def test_a_prompt_that_cannot_reach_the_first_node_ends_the_request_everywhere():
  node = make_node("second")
  first, other = PeerStandIn("first", "10.0.0.1", fail=True), PeerStandIn("other", "10.0.0.2")
  two_node_view(node, first, other)
  await node.lifecycle.start_request("r", SamplingParams())
  with pytest.raises(ConnectionError):
    await node.process_prompt(DUMMY, "hello", request_id="r")
  assert len(node.requests) == 0 and node.requests.ended("r") is Status.FAILED
  await eventually(lambda: node.pending()["tasks"] == 0, 5)
  assert any(s["type"] == "request_error" and s["request_id"] == "r" for s in other.statuses)


async def test_only_a_requests_origin_may_cancel_it_and_only_its_ring_may_fail_it():
  node = make_node("second")
  origin, bystander = PeerStandIn("origin", "10.0.0.1"), PeerStandIn("bystander", "10.0.0.7")
  two_node_view(node, origin, bystander)
  node.peer_hosts["stranger"] = {"10.0.0.8"}  # a peer that is not in this request's ring
  node.receive_status("r", json.dumps({"type": "request_params", "request_id": "r", "params": {}, "origin": "origin"}), "10.0.0.1")
  node.requests.get("r").route = Route((Stage("origin", 0, 0), Stage("second", 1, 1)))
  node.receive_status("r", json.dumps({"type": "cancel_request", "request_id": "r"}), "10.0.0.7")
  node.receive_status("r", json.dumps({"type": "request_error", "request_id": "r", "error": "boom"}), "10.0.0.8")
  assert node.requests.get("r") is not None
  node.receive_status("r", json.dumps({"type": "cancel_request", "request_id": "r"}), "10.0.0.1")
  assert node.requests.ended("r") is Status.CANCELLED


async def test_a_newcomers_placement_facts_heard_before_it_is_known_count_once_it_joins_from_its_own_address():
  """A node that finds this one first announces its facts at once, before this node's discovery has found it: they
  are kept until it joins, then checked against its address like any peer's."""
  node = make_node("here")
  node.placements.enable("auto", 4, 50.0)
  newcomer, impostor = PeerStandIn("newcomer", "10.0.0.1"), PeerStandIn("impostor", "10.0.0.2")
  facts = {"engine": "DummyInferenceEngine", "float_bytes": 4, "memory_mb": 8000, "speed": 50.0, "placement": "auto"}
  node.receive_status("", statuses.PlacementMember.build(node_id="newcomer", **facts), "10.0.0.1")
  node.receive_status("", statuses.PlacementMember.build(node_id="impostor", **facts), "10.0.0.9")  # not where it is reached
  assert [f.node_id for f in node.placements.members()] == ["here"]
  node.peers = [newcomer, impostor]
  node.peer_hosts = {"newcomer": {"10.0.0.1"}, "impostor": {"10.0.0.2"}}
  node.membership.peers_changed([newcomer, impostor], [], [])
  assert [f.node_id for f in node.placements.members()] == ["here", "newcomer"]


class CheckedPeer(PeerStandIn):
  """A peer whose health checks go as scripted: "ok", "refused" (a quick no: its process is gone) or "timeout" (a no
  after the 5 s timeout, on the fake clock `now`)."""

  def __init__(self, peer_id: str, host: str, checks: list, now: list):
    super().__init__(peer_id, host)
    self.checks, self.now = checks, now

  async def health_check(self):
    check = self.checks.pop(0)
    if check == "timeout":
      self.now[0] += 5.0
    return check == "ok"


async def test_a_peer_whose_check_runs_out_once_keeps_its_requests_and_one_that_refuses_loses_them_at_once():
  """A health check that runs out its timeout may be a live peer busy for a moment: its requests go on, and only
  checks that keep running out end them. A refused check (the peer's process is gone) ends them at the first."""
  node, now = make_node("here"), [0.0]
  node.membership.clock = lambda: now[0]
  busy = CheckedPeer("busy", "10.0.0.1", ["timeout", "ok", "timeout", "timeout"], now)
  gone = CheckedPeer("gone", "10.0.0.2", ["refused"], now)
  node.peers, node.peer_hosts = [busy, gone], {"busy": {"10.0.0.1"}, "gone": {"10.0.0.2"}}
  for request_id, peer in (("rb", busy), ("rg", gone)):
    node.receive_status(request_id, json.dumps({"type": "request_params", "request_id": request_id, "params": {}, "origin": peer.id()}), peer.host)
    node.requests.get(request_id).route = Route((Stage(peer.id(), 0, 0), Stage("here", 1, 1)))
  heard = {request_id: node.lifecycle.watch(request_id) for request_id in ("rb", "rg")}

  await node.membership.check_peers()
  await eventually(lambda: node.requests.ended("rg") is Status.FAILED, 5)
  assert (await heard["rg"].get()).error == "node gone at 10.0.0.2:5678 stopped answering during the request (its health check failed)"
  assert node.requests.is_live("rb") and "busy" in node.placements.suspects  # no new work for it meanwhile
  await node.membership.check_peers()  # it answers: trusted again
  assert node.requests.is_live("rb") and "busy" not in node.placements.suspects
  await node.membership.check_peers()
  assert node.requests.is_live("rb")
  await node.membership.check_peers()  # the second in a row that runs out
  await eventually(lambda: node.requests.ended("rb") is Status.FAILED, 5)
  assert (await heard["rb"].get()).error.endswith("stopped answering during the request (2 health checks in a row went unanswered)")

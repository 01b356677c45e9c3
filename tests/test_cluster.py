"""Real `exo` processes forming rings on loopback with manual discovery: 2- and 3-node rings, SmolLM2 split across
them answering token for token as one node does, each node's HTTP API, malformed gRPC input, and a node killed
mid-generation (the request ends with an error within DEAD_NODE_ERROR_BOUND_S) then restarted (the ring re-forms).

Readiness is polled (gRPC CollectTopology until every node sees the same ring, /healthcheck, log lines)."""
import asyncio
import json
import sys
import time
from typing import Optional

import aiohttp
import grpc
import numpy as np
import pytest

from exo.download.shard_download import NoopShardDownloader
from exo.inference.dummy_inference_engine import DummyInferenceEngine
from exo.inference.shard import Shard
from exo.networking.grpc import node_service_pb2 as pb
from exo.networking.grpc import node_service_pb2_grpc as pb_grpc
from exo.networking.grpc.codec import encode_tensor
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.networking.grpc.grpc_server import GRPCServer
from exo.networking.manual.manual_discovery import ManualDiscovery
from exo.orchestration import statuses
from exo.orchestration.generation import GenerationError, generate
from exo.orchestration.node import Node
from exo.orchestration.requests import Status
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.cluster import QUESTION, TOKEN_LINE, Cluster, ExoProcess, chat, free_port, node_args, tokens_of, wait_for_ring, write_manual_config
from tests.support.waiting import eventually

pytestmark = pytest.mark.cluster

# A request whose next hop dies ends with an error naming that node within this bound: a forward to it fails at once
# (connection refused), and a request waiting on it ends at the node's next health check of the peers its live
# requests need (every 2 s, 5 s timeout).
DEAD_NODE_ERROR_BOUND_S = 10

pytest.importorskip("exo.api", reason="the HTTP API (exo.api) is not installed")


# --- dummy engine: ring formation, APIs, malformed input (upstream CI's two-node check) ---

@pytest.fixture(scope="module")
def dummy_pair(tmp_path_factory):
  cluster = Cluster(tmp_path_factory.mktemp("dummy_pair"), ["node1", "node2"], "dummy", {"DEBUG": "7", "DEBUG_DISCOVERY": "7"})
  try:
    asyncio.run(cluster.start())  # a plain fixture: its processes outlive any one test's event loop
    yield cluster
  finally:
    cluster.stop()


async def test_two_dummy_nodes_discover_each_other_and_serve_chat_on_each_api(dummy_pair):
  for me, other in (("node1", "node2"), ("node2", "node1")):
    await dummy_pair.nodes[me].wait_for_log(rf"^Peer statuses: \{{'{other}': 'is_connected=True, health_check=True", 15)
  for node_id in ("node1", "node2"):
    reply = await chat(dummy_pair.url(node_id), "dummy", "Hello")
    assert reply["choices"][0]["message"]["content"] == "dummy" * 10 and reply["choices"][0]["finish_reason"] == "stop"
    assert reply["usage"] == {"prompt_tokens": 1, "completion_tokens": 10, "total_tokens": 11}
  for node in dummy_pair.nodes.values():
    assert "Failed to connect peers:" not in node.log()


async def test_malformed_grpc_input_gets_invalid_argument_and_the_node_keeps_serving(dummy_pair):
  port = dummy_pair.ports["node1"]
  own = pb.Shard(model_id="dummy", start_layer=4, end_layer=7, n_layers=8)  # node1's layers (node2 is P0)
  bad = [
    (pb.TensorRequest(shard=own, request_id="bad1", tensor=pb.Tensor(tensor_data=b"\1\2\3", shape=[1, 1], dtype="int64")), "bytes"),
    (pb.TensorRequest(shard=own, tensor=pb.Tensor(tensor_data=b"\0" * 8, shape=[1, 1], dtype="complex-ish")), "dtype"),
    (pb.TensorRequest(shard=pb.Shard(model_id="llama-9000", end_layer=3, n_layers=8), tensor=encode_tensor(np.array([[1]]))), "unknown model"),
    (pb.TensorRequest(shard=pb.Shard(model_id="dummy", end_layer=40, n_layers=8), tensor=encode_tensor(np.array([[1]]))), "layers"),
    (pb.TensorRequest(shard=pb.Shard(model_id="dummy", end_layer=3, n_layers=8), tensor=encode_tensor(np.array([[1]]))), "ring differs"),
    (pb.PromptRequest(shard=pb.Shard(model_id="dummy", n_layers=9), prompt="x"), "layers"),
  ]
  async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
    stub = pb_grpc.NodeServiceStub(channel)
    for request, detail in bad:
      call = stub.SendPrompt if isinstance(request, pb.PromptRequest) else stub.SendTensor
      with pytest.raises(grpc.aio.AioRpcError) as error:
        await call(request, timeout=5)
      assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and detail in error.value.details(), error.value
    # Statuses that cannot be acted on are dropped (one log line each); the node goes on with the next ones.
    for status in ('{"type": "request_params", "request_id": "m1", "params": []}', '{"type": "node_status", "status": 5}', "{not json"):
      await stub.SendOpaqueStatus(pb.SendOpaqueStatusRequest(request_id="m1", status=status), timeout=5)
  assert dummy_pair.nodes["node1"].running()
  reply = await chat(dummy_pair.url("node1"), "dummy", "still there?")
  assert reply["choices"][0]["message"]["content"] == "dummy" * 10
  assert dummy_pair.nodes["node1"].current_log().count("dropped an invalid status from 127.0.0.1") == 3


async def test_a_stranger_gets_permission_denied_for_request_messages(tmp_path):
  """A node alone in its ring takes no request messages from anyone (here: this test's process, at 127.0.0.1, which
  is no member): an invented request id sent by a stranger starts nothing."""
  cluster = Cluster(tmp_path, ["lone"], "dummy", {})
  try:
    await cluster.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.ports['lone']}") as channel:
      stub = pb_grpc.NodeServiceStub(channel)
      tensor = pb.TensorRequest(shard=pb.Shard(model_id="dummy", end_layer=7, n_layers=8), request_id="invented", tensor=encode_tensor(np.array([[1]])))
      with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.SendTensor(tensor, timeout=5)
      assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
      assert (await stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)).is_healthy
    async with aiohttp.ClientSession() as session:
      async with session.get(f"{cluster.url('lone')}/v1/state") as response:
        assert (await response.json())["requests"] == []
  finally:
    cluster.stop()


async def test_a_third_node_listed_in_the_reloaded_config_joins_the_ring(dummy_pair):
  """The running pair re-reads its config when the file's mtime increases: node3 is added there, started, and all
  three agree on one ring; each node's API answers through it."""
  dummy_pair.ports["node3"] = free_port()
  dummy_pair.api_ports["node3"] = free_port()
  write_manual_config(dummy_pair.config, dummy_pair.ports)
  workdir = dummy_pair.config.parent
  dummy_pair.nodes["node3"] = ExoProcess("node3", node_args(dummy_pair.ports["node3"], dummy_pair.api_ports["node3"], dummy_pair.config, "dummy"),
                                         workdir, {"DEBUG": "1"})
  await dummy_pair.start(["node3"])
  views = await wait_for_ring(dummy_pair.ports, 30)
  assert all(set(view.nodes) == {"node1", "node2", "node3"} for view in views.values())
  for node_id in dummy_pair.nodes:
    reply = await chat(dummy_pair.url(node_id), "dummy", "Hi")
    assert reply["choices"][0]["message"]["content"] == "dummy" * 10


# --- in-process ring (real gRPC on loopback), where timing can be controlled ---

class SlowDummyEngine(DummyInferenceEngine):
  """The dummy engine, slowed so a generation is still running when the ring changes; counts hops per request."""

  def __init__(self, hop_s: float):
    super().__init__()
    self.hop_s = hop_s
    self.hops = {}
    self.in_hop = 0  # hops running now

  async def infer_tensor(self, request_id, shard, input_data, inference_state=None):
    self.hops[request_id] = self.hops.get(request_id, 0) + 1
    self.in_hop += 1
    try:
      await asyncio.sleep(self.hop_s)  # the hop's work
    finally:
      self.in_hop -= 1
    return await super().infer_tensor(request_id, shard, input_data, inference_state)


async def start_inprocess_node(node_id: str, port: int, config, engine: Optional[DummyInferenceEngine] = None) -> Node:
  discovery = ManualDiscovery(str(config), node_id, GRPCPeerHandle, poll_interval=0.2)
  node = Node(node_id, None, engine or SlowDummyEngine(0.4), discovery, NoopShardDownloader(), RingMemoryWeightedPartitioningStrategy())
  node.server = GRPCServer(node, "127.0.0.1", port)
  await node.start()
  return node


async def test_a_node_joining_mid_generation_ends_the_request_with_an_error_and_leaves_no_zombie(tmp_path):
  """Layer ranges follow membership, so a request in flight when the ring changes cannot go on: its client gets
  an error, and no hop keeps circulating it round the new ring."""
  ports = {"a": free_port(), "b": free_port(), "c": free_port()}
  config = write_manual_config(tmp_path / "peers.json", {"a": ports["a"], "b": ports["b"]})
  nodes = [await start_inprocess_node(i, ports[i], config) for i in ("a", "b")]
  try:
    await wait_for_ring({"a": ports["a"], "b": ports["b"]}, 20)
    base = Shard("dummy", 0, 0, 8)
    stream = generate(nodes[0], base, "hello", request_id="mid-join", timeout=30)
    assert (await anext(stream))[0] == [2]
    write_manual_config(config, ports)
    nodes.append(await start_inprocess_node("c", ports["c"], config))
    started = time.monotonic()
    with pytest.raises(GenerationError, match="ring changed"):
      async for _ in stream:
        pass
    assert time.monotonic() - started < 5  # membership is re-read every 2 s
    # No zombie: every node has ended it (a hop that arrives later finds it ended and is dropped), no hop of it is
    # running and no node still sends one on.
    quiet = lambda: all(node.requests.ended("mid-join") is Status.FAILED and node.inference_engine.in_hop == 0
                        and node.pending()["tasks"] == 0 for node in nodes)
    await eventually(quiet, 10, "the failed request ended on every node, nothing in flight")
    assert all("mid-join" not in node.outstanding_requests for node in nodes)
  finally:
    await asyncio.gather(*[node.stop() for node in nodes])


class HeldDummyEngine(SlowDummyEngine):
  """SlowDummyEngine whose hops wait, once `held` is cleared, until it is set again; `holding` is set when one does."""

  def __init__(self, hop_s: float):
    super().__init__(hop_s)
    self.held, self.holding = asyncio.Event(), asyncio.Event()
    self.held.set()

  async def infer_tensor(self, request_id, shard, input_data, inference_state=None):
    result = await super().infer_tensor(request_id, shard, input_data, inference_state)
    if not self.held.is_set():
      self.holding.set()
      await self.held.wait()
    return result


async def test_a_node_dropped_from_the_ring_while_it_still_runs_hears_that_its_requests_failed(tmp_path):
  """a stops counting b as a peer (here: b leaves a's discovery file; in life: missed health checks) while b, still
  up and seeing a, waits for a's next hop of a request. a fails the request, and no later status of a's reaches a
  node that is not its peer: b would keep that request (and its KV) for good. a tells it on the way out."""
  ports = {"a": free_port(), "b": free_port()}
  config_a = write_manual_config(tmp_path / "peers-a.json", ports)
  config_b = write_manual_config(tmp_path / "peers-b.json", ports)
  nodes = [await start_inprocess_node("a", ports["a"], config_a, HeldDummyEngine(0.1)), await start_inprocess_node("b", ports["b"], config_b)]
  engine_a, told_b = nodes[0].inference_engine, asyncio.Event()
  # b's observers run after b has acted on a status
  nodes[1].on_opaque_status.register("test").on_next(
    lambda request_id, raw: request_id == "dropped-b" and json.loads(raw).get("type") == statuses.REQUEST_ERROR and told_b.set())
  try:
    await wait_for_ring(ports, 20)
    stream = generate(nodes[0], Shard("dummy", 0, 0, 8), "hello", request_id="dropped-b", timeout=30)
    assert (await anext(stream))[0] == [2]
    engine_a.held.clear()
    await asyncio.wait_for(engine_a.holding.wait(), 10)  # the request's next hop is held at a; b waits for it
    assert nodes[1].requests.is_live("dropped-b")
    write_manual_config(config_a, {"a": ports["a"]})
    with pytest.raises(GenerationError, match="node b at .* left the ring during the request"):
      async for _ in stream:
        pass
    await asyncio.wait_for(told_b.wait(), 5)
    assert nodes[1].requests.ended("dropped-b") is Status.FAILED
    assert [p.id() for p in nodes[1].peers] == ["a"]  # b never lost sight of a: only a's word ended the request there
  finally:
    engine_a.held.set()
    await asyncio.gather(*[node.stop() for node in nodes])


# --- SmolLM2 split across real processes ---

@pytest.fixture(scope="module")
def smol_pair(tmp_path_factory):
  """node-a and node-b (ring order: node-b holds layers 0-14, node-a 15-29 and samples). node-a first answers alone,
  as a ring of one: that is the one-node reference the ring must reproduce token for token. When node-b joins,
  node-a's shard changes from the whole model to layers 15-29 and its engine must reload."""
  cluster = Cluster(tmp_path_factory.mktemp("smol_pair"), ["node-a", "node-b"], "numpy", {"DEBUG": "2"})

  async def form():
    cluster.nodes["node-a"].start()
    await cluster.wait_api("node-a")
    reply = await chat(cluster.url("node-a"), "smollm2-135m", QUESTION, logprobs=True, top_logprobs=2)
    cluster.reference_text = reply["choices"][0]["message"]["content"]
    cluster.reference_logprobs = reply["choices"][0]["logprobs"]["content"]
    cluster.reference_tokens = tokens_of(cluster.nodes["node-a"].log(), reply["id"].removeprefix("chatcmpl-"))
    assert cluster.reference_text.startswith("The capital of France is Paris."), reply
    assert cluster.reference_tokens and len(cluster.reference_tokens) == reply["usage"]["completion_tokens"]
    await cluster.start(["node-b"])
  try:
    asyncio.run(form())  # a plain fixture: its processes outlive any one test's event loop
    yield cluster
  finally:
    cluster.stop()


async def test_smollm2_split_over_two_nodes_answers_as_one_node(smol_pair):
  reply = await chat(smol_pair.url("node-a"), "smollm2-135m", QUESTION)
  request_id = reply["id"].removeprefix("chatcmpl-")
  assert reply["choices"][0]["message"]["content"] == smol_pair.reference_text
  assert tokens_of(smol_pair.nodes["node-a"].log(), request_id) == smol_pair.reference_tokens


async def test_logprobs_sampled_on_one_node_reach_the_origin_on_another(smol_pair):
  """node-b (first layers) is the origin, node-a samples: each token's logprobs travel to node-b as a status ahead of
  the token, and come out as a one-node run's."""
  reply = await chat(smol_pair.url("node-b"), "smollm2-135m", QUESTION, logprobs=True, top_logprobs=2)
  assert reply["choices"][0]["message"]["content"] == smol_pair.reference_text
  entries = reply["choices"][0]["logprobs"]["content"]
  assert len(entries) == reply["usage"]["completion_tokens"] == len(smol_pair.reference_logprobs)
  for got, want in zip(entries, smol_pair.reference_logprobs):
    assert got["token"] == want["token"] and got["top_logprobs"][0]["token"] == got["token"]
    assert abs(got["logprob"] - want["logprob"]) < 1e-3 and got["logprob"] <= 0


async def read_stream_until_error(url: str, on_content) -> tuple:
  """Stream a long answer; call on_content(n) after each content chunk; return (chunks, error or None, end time)."""
  body = {"model": "smollm2-135m", "stream": True, "temperature": 0, "max_tokens": 400,
          "messages": [{"role": "user", "content": "Write a long story about a dragon who learns to cook."}]}
  chunks, error = 0, None
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=240)) as response:
      assert response.status == 200
      async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
          error = event["error"]
          break
        if event["choices"][0]["delta"].get("content"):
          chunks += 1
          on_content(chunks)
  return chunks, error, time.monotonic()


async def test_killed_node_ends_the_request_with_an_error_and_a_restart_reforms_the_ring(smol_pair):
  killed_at = []

  def kill_after_three_chunks(chunks):
    if chunks == 3:
      smol_pair.nodes["node-b"].kill()
      killed_at.append(time.monotonic())

  chunks, error, ended_at = await read_stream_until_error(smol_pair.url("node-a"), kill_after_three_chunks)
  log_a = smol_pair.nodes["node-a"].log()[-4000:]
  assert killed_at, f"the answer ended after {chunks} chunks, before the kill"
  assert error is not None, f"stream ended without an error after {chunks} chunks:\n{log_a}"
  assert "node node-b" in error["message"], (error, log_a)
  print(f"error {ended_at - killed_at[0]:.1f} s after the kill: {error['message']}", file=sys.stderr)
  assert ended_at - killed_at[0] < DEAD_NODE_ERROR_BOUND_S, (error, log_a)

  # node-a must notice the departure first; a restart inside that window would look like a brief flap instead.
  await wait_for_ring({"node-a": smol_pair.ports["node-a"]}, 30)
  await smol_pair.start(["node-b"])  # the ring re-formed and node-a places requests over both nodes again
  reply = await chat(smol_pair.url("node-a"), "smollm2-135m", QUESTION)
  assert reply["choices"][0]["message"]["content"] == smol_pair.reference_text, (reply, smol_pair.nodes["node-a"].log()[-4000:])
  assert tokens_of(smol_pair.nodes["node-a"].log(), reply["id"].removeprefix("chatcmpl-")) == smol_pair.reference_tokens


async def test_smollm2_split_over_three_nodes_with_exo_run_driving(smol_pair):
  """`exo run ... --wait-for-peers 2` joins the pair as a third node (added to the config file, which the running
  nodes re-read): its printed answer and the last node's sampled tokens equal the one-node reference. When it
  exits, the pair re-forms as a ring of two."""
  ports = dict(smol_pair.ports, **{"node-z": free_port()})
  write_manual_config(smol_pair.config, ports)  # hot reload: the running nodes pick up node-z by mtime
  workdir = smol_pair.config.parent
  driver = ExoProcess("node-z", ["run", "smollm2-135m", "--prompt", QUESTION, "--inference-engine", "numpy", "--node-host", "127.0.0.1",
                                 "--node-port", str(ports["node-z"]), "--discovery-module", "manual", "--discovery-config-path",
                                 str(smol_pair.config), "--wait-for-peers", "2"], workdir, {"DEBUG": "2"})
  log_a = len(smol_pair.nodes["node-a"].log())
  try:
    assert driver.start().wait(240) == 0, driver.log()[-3000:]
  finally:
    driver.stop()
    write_manual_config(smol_pair.config, smol_pair.ports)
  assert "The capital of France is Paris." in driver.log()
  # Ring order is node-z, node-b, node-a (equal memory, ids descending): node-a holds layers 19-29 and samples.
  new_log = smol_pair.nodes["node-a"].log()[log_a:]
  assert tokens_of(new_log, next(TOKEN_LINE.finditer(new_log))["rid"]) == smol_pair.reference_tokens
  await wait_for_ring(smol_pair.ports, 30, smol_pair.nodes.values())

"""A real gRPC server on loopback answering a real client: every RPC reaches the node, calls from outside the ring
and malformed input are refused with a gRPC status while the server keeps serving, compression and keepalive as
upstream nodes expect them."""
import asyncio
import json

import grpc
import numpy as np
import pytest

from exo.inference.dummy_inference_engine import DummyInferenceEngine
from exo.inference.shard import Shard
from exo.networking.grpc import grpc_peer_handle, grpc_server
from exo.networking.grpc import node_service_pb2 as pb
from exo.networking.grpc import node_service_pb2_grpc as pb_grpc
from exo.networking.grpc.codec import encode_tensor
from exo.networking.grpc.grpc_peer_handle import CHANNEL_OPTIONS, GRPCPeerHandle
from exo.networking.grpc.grpc_server import GRPCServer
from exo.orchestration.steps.loop import accept
from exo.topology.device_capabilities import DeviceCapabilities, DeviceFlops
from exo.topology.topology import Topology
from tests.support.cluster import free_port

pytestmark = pytest.mark.cluster


def caps(memory: int) -> DeviceCapabilities:
  return DeviceCapabilities(model="test", chip="test", memory=memory, flops=DeviceFlops(fp32=0, fp16=0, int8=0))


class RecordingNode:
  """Just what GRPCServer touches of a Node, recording each call."""

  def __init__(self):
    self.inference_engine = DummyInferenceEngine()
    self.calls = asyncio.Queue()
    self.members = {"127.0.0.1"}  # the hosts whose calls it takes
    self.ended = set()  # request ids whose prompt it refuses
    self.current_topology = Topology()
    self.current_topology.update_node("server", caps(4096))
    self.current_topology.add_edge("server", "client", "MAN")

  def get_current_shard(self, base_shard):
    return Shard(base_shard.model_id, 4, 7, 8) if base_shard.model_id == "dummy" else base_shard  # this node: layers 4-7

  async def process_prompt(self, shard, prompt, request_id=None, inference_state=None, accepted=None):
    self.calls.put_nowait(("prompt", shard, prompt, request_id, inference_state))

  async def process_tensor(self, shard, tensor, request_id=None, inference_state=None, accepted=None):
    self.calls.put_nowait(("tensor", shard, tensor, request_id, inference_state))

  def on_result(self, request_id, result, is_finished, sender_host=None):
    self.calls.put_nowait(("result", request_id, result, is_finished))

  def receive_status(self, request_id, status, sender_host=None):
    self.calls.put_nowait(("status", request_id, status))

  def is_member_host(self, host):
    return host in self.members

  def accepts_prompt(self, request_id):
    if request_id in self.ended:
      raise ValueError(f"request {request_id} has already ended")


@pytest.fixture
async def served():
  node = RecordingNode()
  port = free_port()
  server = GRPCServer(node, "127.0.0.1", port)
  await server.start()
  peer = GRPCPeerHandle("server", f"127.0.0.1:{port}", "MAN", caps(4096))
  yield node, server, peer, port
  await peer.disconnect()
  await server.stop()


async def next_call(node):
  return await asyncio.wait_for(node.calls.get(), 5)


DUMMY = Shard("dummy", 4, 7, 8)


async def test_rpcs_reach_the_node(served):
  node, _, peer, _ = served
  assert await peer.health_check()
  await peer.connect()
  assert await peer.is_connected()
  await peer.send_prompt(DUMMY, "hi there", request_id="r1", inference_state={"dropped": np.ones(2)})
  assert await next_call(node) == ("prompt", DUMMY, "hi there", "r1", {})  # state never goes to peers
  await peer.send_tensor(DUMMY, np.array([[5]], dtype=np.int64), request_id="r1")
  kind, shard, tensor, rid, state = await next_call(node)
  assert (kind, shard, rid, state, tensor.dtype, tensor.tolist()) == ("tensor", DUMMY, "r1", {}, np.int64, [[5]])
  await peer.send_result("r1", [7], False)
  assert await next_call(node) == ("result", "r1", [7], False)
  await peer.send_result("img", np.zeros((2, 2, 3), np.uint8), True)
  kind, rid, image, finished = await next_call(node)
  assert image.shape == (2, 2, 3) and finished
  await peer.send_opaque_status("r1", '{"type": "node_status"}')
  assert await next_call(node) == ("status", "r1", '{"type": "node_status"}')
  topology = await peer.collect_topology({"client"}, 3)
  assert topology.nodes == {"server": caps(4096)} and [c.to_id for c in topology.peer_graph["server"]] == ["client"]


async def test_calls_about_requests_from_outside_the_ring_are_refused(served):
  """Only ring members (by address) may start, feed or end requests; anyone may ask for health and topology."""
  node, _, peer, _ = served
  node.members = {"10.255.0.1"}
  for call in (peer.send_prompt(DUMMY, "hi", request_id="x"), peer.send_tensor(DUMMY, np.array([[5]]), request_id="x"),
               peer.send_result("x", [1], True), peer.send_opaque_status("x", '{"type": "cancel_request", "request_id": "x"}')):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
      await call
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not a member" in refused.value.details()
  assert node.calls.empty()
  assert await peer.health_check()
  assert (await peer.collect_topology(set(), 1)).nodes


async def test_a_prompt_for_an_ended_request_is_refused(served):
  node, _, peer, _ = served
  node.ended.add("over")
  with pytest.raises(grpc.aio.AioRpcError) as refused:
    await peer.send_prompt(DUMMY, "again", request_id="over")
  assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "already ended" in refused.value.details()
  assert node.calls.empty()


async def test_large_hidden_states_pass(served):
  node, _, peer, _ = served
  hidden = np.random.default_rng(0).standard_normal((1, 2048, 1536)).astype(np.float32)  # 12 MiB, beyond gRPC's 4 MiB default
  await peer.send_tensor(Shard("dummy", 4, 7, 8), hidden, request_id="big")
  assert np.array_equal((await next_call(node))[2], hidden)


async def test_a_tensor_is_answered_when_its_forward_pass_starts(served, monkeypatch):
  """Replying costs the server about as much as receiving: a batch's messages are answered while its step runs,
  once the node announces the pass, or when the work ends, or after REPLY_WAIT_S at the latest."""
  node, _, peer, _ = served
  gates = {rid: (asyncio.Event(), asyncio.Event()) for rid in ("announced", "ended", "stuck")}

  async def process_tensor(shard, tensor, request_id=None, inference_state=None, accepted=None):
    start, end = gates[request_id]
    node.calls.put_nowait(("tensor", request_id))
    await start.wait()
    if request_id == "announced":
      accept(accepted)
    await end.wait()
  node.process_tensor = process_tensor
  monkeypatch.setattr(grpc_server, "REPLY_WAIT_S", 60.0)
  sends = {rid: asyncio.ensure_future(peer.send_tensor(DUMMY, np.ones((1, 1, 4), np.float32), request_id=rid)) for rid in ("announced", "ended")}
  assert {await next_call(node), await next_call(node)} == {("tensor", "announced"), ("tensor", "ended")}
  done, _ = await asyncio.wait(sends.values(), timeout=0.3)
  assert not done  # both are waiting for their forward pass
  gates["announced"][0].set()
  await asyncio.wait_for(sends["announced"], 5)  # answered while its work goes on
  assert not sends["ended"].done()
  gates["ended"][0].set()
  gates["ended"][1].set()  # ends without announcing (a node without batching that failed, say)
  await asyncio.wait_for(sends["ended"], 5)
  monkeypatch.setattr(grpc_server, "REPLY_WAIT_S", 0.05)
  await asyncio.wait_for(peer.send_tensor(DUMMY, np.ones((1, 1, 4), np.float32), request_id="stuck"), 5)
  assert await next_call(node) == ("tensor", "stuck")
  gates["announced"][1].set()
  gates["stuck"][0].set()
  gates["stuck"][1].set()


async def test_tensors_and_token_rows_travel_uncompressed_and_other_calls_gzipped(served):
  """Counts the bytes on the wire through a loopback relay. (grpc.aio ignores a call's compression=NoCompression on
  a channel whose default is gzip; tensors were silently gzipped, ~6 ms of the sender's loop per prompt message.)"""
  node, _, _, port = served
  sent = 0  # bytes from the client to the server

  async def relay(client_reader, client_writer):
    server_reader, server_writer = await asyncio.open_connection("127.0.0.1", port)

    async def pipe(reader, writer, counted):
      nonlocal sent
      while data := await reader.read(1 << 16):
        sent += len(data) if counted else 0
        writer.write(data)
        await writer.drain()
      writer.close()
    await asyncio.gather(pipe(client_reader, server_writer, True), pipe(server_reader, client_writer, False), return_exceptions=True)

  relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
  peer = GRPCPeerHandle("server", f"127.0.0.1:{relay_server.sockets[0].getsockname()[1]}", "MAN", caps(4096))
  try:
    await peer.connect()
    zeros = np.zeros((1, 256, 1024), np.float32)  # 1 MiB that gzip would shrink a thousandfold
    before = sent
    await peer.send_tensor(DUMMY, zeros, request_id="r1")
    await next_call(node)
    assert sent - before > zeros.nbytes
    before = sent
    status = json.dumps({"type": "padding", "text": "a" * zeros.nbytes})
    await peer.send_opaque_status("r1", status)
    assert await next_call(node) == ("status", "r1", status)
    assert sent - before < zeros.nbytes // 10
    before = sent  # a step's token rows: uncompressed, as the other calls that carry token ids
    rows = json.dumps({"type": "tokens", "node_id": "client", "rows": [[f"request-{i}", [0] * 64, False, None] for i in range(4096)]})
    await peer.send_token_rows(rows)
    assert await next_call(node) == ("status", "", rows)
    assert sent - before > len(rows)
  finally:
    await peer.disconnect()
    relay_server.close()


async def test_uncompressed_upstream_style_calls_are_accepted(served):
  node, _, _, port = served
  async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:  # no gzip, default options
    stub = pb_grpc.NodeServiceStub(channel)
    request = pb.TensorRequest(shard=pb.Shard(model_id="dummy", start_layer=4, end_layer=7, n_layers=8),
                               tensor=encode_tensor(np.array([[1]])))  # no request_id, no state: read as "" and {}
    await stub.SendTensor(request)
  assert (await next_call(node))[3:] == ("", {})


@pytest.mark.parametrize("make_request, detail", [
  (lambda: pb.TensorRequest(shard=pb.Shard(model_id="dummy", start_layer=4, end_layer=7, n_layers=8),
                            tensor=pb.Tensor(tensor_data=b"\0" * 3, shape=[1, 1], dtype="int64")), "bytes"),
  (lambda: pb.TensorRequest(shard=pb.Shard(model_id="dummy", start_layer=4, end_layer=7, n_layers=8),
                            tensor=pb.Tensor(tensor_data=b"\0" * 2, shape=[1, 1], dtype="bfloat16")), "dtype"),
  (lambda: pb.TensorRequest(shard=pb.Shard(model_id="no-such-model", end_layer=3, n_layers=8),
                            tensor=encode_tensor(np.array([[1]]))), "unknown model"),
  (lambda: pb.TensorRequest(shard=pb.Shard(model_id="dummy", end_layer=3, n_layers=30),
                            tensor=encode_tensor(np.array([[1]]))), "layers"),
  (lambda: pb.TensorRequest(shard=pb.Shard(model_id="dummy", start_layer=5, end_layer=3, n_layers=8),
                            tensor=encode_tensor(np.array([[1]]))), "layers"),
  (lambda: pb.TensorRequest(shard=pb.Shard(model_id="smollm2-135m", end_layer=3, n_layers=30),
                            tensor=encode_tensor(np.array([[1]]))), "cannot run"),
  (lambda: pb.TensorRequest(shard=pb.Shard(model_id="dummy", start_layer=4, end_layer=7, n_layers=8)), "without a tensor"),
  (lambda: pb.TensorRequest(shard=pb.Shard(model_id="dummy", end_layer=3, n_layers=8), tensor=encode_tensor(np.array([[1]]))), "ring differs"),
  (lambda: pb.PromptRequest(shard=pb.Shard(model_id="", n_layers=8), prompt="x"), "model_id"),
])
async def test_malformed_input_gets_invalid_argument_and_the_server_keeps_serving(served, make_request, detail):
  node, _, peer, port = served
  request = make_request()
  async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
    stub = pb_grpc.NodeServiceStub(channel)
    call = stub.SendPrompt if isinstance(request, pb.PromptRequest) else stub.SendTensor
    with pytest.raises(grpc.aio.AioRpcError) as error:
      await call(request, timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and detail in error.value.details()
    assert (await stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)).is_healthy
  assert node.calls.empty()


async def test_health_check_of_a_dead_peer_fails_fast(monkeypatch):
  monkeypatch.setattr(grpc_peer_handle, "CONNECT_TIMEOUT_S", 1.0)  # 10 s in production, as upstream
  peer = GRPCPeerHandle("ghost", f"127.0.0.1:{free_port()}", "MAN", caps(1))
  start = asyncio.get_running_loop().time()
  assert not await peer.health_check()
  assert asyncio.get_running_loop().time() - start < 3
  with pytest.raises(ConnectionError, match="unreachable"):
    await asyncio.wait_for(peer.send_result("r", [1], True), 5)
  await peer.disconnect()


async def test_idle_client_keepalive_pings_do_not_get_goaway(served):
  """Upstream clients ping every 10 s even with no call in flight. gRPC's default server answers a few such pings
  with GOAWAY "too_many_pings" (seen here after ~17 s at one ping per 6 s, the third ping); ours keeps the
  connection: its state must not change while three idle pings go by."""
  _, _, _, port = served
  options = dict(CHANNEL_OPTIONS, **{"grpc.keepalive_time_ms": 6000, "grpc.http2.min_time_between_pings_ms": 6000})  # faster than upstream
  async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=list(options.items())) as channel:
    stub = pb_grpc.NodeServiceStub(channel)
    assert (await stub.HealthCheck(pb.HealthCheckRequest(), timeout=5)).is_healthy
    assert channel.get_state() == grpc.ChannelConnectivity.READY
    with pytest.raises(asyncio.TimeoutError):  # idle: only keepalive pings on the wire, at 6, 12 and 18 s
      await asyncio.wait_for(channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 20)
    assert channel.get_state() == grpc.ChannelConnectivity.READY

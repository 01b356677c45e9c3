"""The gRPC wire contract (docs/architecture.md, "The ring"): the schema upstream nodes speak, the committed stubs,
encodings, channel options and the client's resend of refused streams. A real server: test_wire_server.py."""
import filecmp
import json
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from exo.networking.grpc import grpc_peer_handle
from exo.networking.grpc import node_service_pb2 as pb
from exo.networking.grpc.codec import (decode_inference_state, decode_tensor, decode_topology, encode_inference_state,
                                       encode_tensor, encode_topology, is_empty_tensor)
from exo.networking.grpc.grpc_peer_handle import CHANNEL_OPTIONS, GRPCPeerHandle
from exo.networking.grpc.grpc_server import SERVER_OPTIONS
from exo.topology.device_capabilities import DeviceCapabilities, DeviceFlops
from exo.topology.topology import Topology

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
GRPC_DIR = REPO / "exo" / "networking" / "grpc"

# The schema upstream nodes speak, which no change may touch: NodeService's RPCs (request, reply), and each message's
# fields as (number, name, type, label). A field's type is its scalar type or message name; maps as map<key,value>.
RPCS = {"SendPrompt": ("PromptRequest", "Tensor"), "SendTensor": ("TensorRequest", "Tensor"), "SendExample": ("ExampleRequest", "Loss"),
        "CollectTopology": ("CollectTopologyRequest", "Topology"), "SendResult": ("SendResultRequest", "Empty"),
        "SendOpaqueStatus": ("SendOpaqueStatusRequest", "Empty"), "HealthCheck": ("HealthCheckRequest", "HealthCheckResponse")}
MESSAGES = {
  "Shard": [(1, "model_id", "string", ""), (2, "start_layer", "int32", ""), (3, "end_layer", "int32", ""), (4, "n_layers", "int32", "")],
  "PromptRequest": [(1, "shard", "Shard", ""), (2, "prompt", "string", ""), (3, "request_id", "string", "optional"),
                    (4, "inference_state", "InferenceState", "optional")],
  "TensorRequest": [(1, "shard", "Shard", ""), (2, "tensor", "Tensor", ""), (3, "request_id", "string", "optional"),
                    (4, "inference_state", "InferenceState", "optional")],
  "ExampleRequest": [(1, "shard", "Shard", ""), (2, "example", "Tensor", ""), (3, "target", "Tensor", ""), (4, "length", "Tensor", ""),
                     (5, "train", "bool", ""), (6, "request_id", "string", "optional")],
  "Loss": [(1, "loss", "float", ""), (2, "grads", "Tensor", "optional")],
  "Tensor": [(1, "tensor_data", "bytes", ""), (2, "shape", "int32", "repeated"), (3, "dtype", "string", "")],
  "TensorList": [(1, "tensors", "Tensor", "repeated")],
  "InferenceState": [(1, "tensor_data", "map<string,Tensor>", ""), (2, "tensor_list_data", "map<string,TensorList>", ""),
                     (3, "other_data_json", "string", "")],
  "CollectTopologyRequest": [(1, "visited", "string", "repeated"), (2, "max_depth", "int32", "")],
  "Topology": [(1, "nodes", "map<string,DeviceCapabilities>", ""), (2, "peer_graph", "map<string,PeerConnections>", "")],
  "PeerConnection": [(1, "to_id", "string", ""), (2, "description", "string", "optional")],
  "PeerConnections": [(1, "connections", "PeerConnection", "repeated")],
  "DeviceFlops": [(1, "fp32", "double", ""), (2, "fp16", "double", ""), (3, "int8", "double", "")],
  "DeviceCapabilities": [(1, "model", "string", ""), (2, "chip", "string", ""), (3, "memory", "int32", ""), (4, "flops", "DeviceFlops", "")],
  "SendResultRequest": [(1, "request_id", "string", ""), (2, "result", "int32", "repeated"), (3, "tensor", "Tensor", "optional"),
                        (4, "is_finished", "bool", "")],
  "SendOpaqueStatusRequest": [(1, "request_id", "string", ""), (2, "status", "string", "")],
  "HealthCheckRequest": [],
  "HealthCheckResponse": [(1, "is_healthy", "bool", "")],
  "Empty": [],
}


def proto_schema(proto: Path, tmp_path: Path):
  """The package, RPCs and messages of `proto` as protoc itself reads it (not the committed stubs)."""
  from google.protobuf import descriptor_pb2
  from grpc_tools import protoc
  out = tmp_path / "schema.pb"
  assert protoc.main(["protoc", f"-I{proto.parent}", f"--descriptor_set_out={out}", proto.name]) == 0
  (file,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
  scalar = {number: name[len("TYPE_"):].lower() for name, number in descriptor_pb2.FieldDescriptorProto.Type.items()}
  maps = {f".{file.package}.{m.name}.{n.name}": n for m in file.message_type for n in m.nested_type if n.options.map_entry}

  def type_of(field) -> str:
    if field.type_name in maps:
      key, value = maps[field.type_name].field
      return f"map<{type_of(key)},{type_of(value)}>"
    return field.type_name.rsplit(".", 1)[-1] if field.type_name else scalar[field.type]

  def label_of(field) -> str:
    if field.proto3_optional:
      return "optional"
    return "repeated" if field.label == field.LABEL_REPEATED and field.type_name not in maps else ""
  messages = {m.name: [(f.number, f.name, type_of(f), label_of(f)) for f in m.field] for m in file.message_type}
  (service,) = file.service
  rpcs = {m.name: (m.input_type.rsplit(".", 1)[-1], m.output_type.rsplit(".", 1)[-1]) for m in service.method}
  return file.package, service.name, rpcs, messages


def test_proto_matches_the_contract(tmp_path):
  package, service, rpcs, messages = proto_schema(GRPC_DIR / "node_service.proto", tmp_path)
  assert (package, service) == ("node_service", "NodeService")
  assert rpcs == RPCS
  assert messages == MESSAGES


def test_committed_stubs_are_what_the_proto_generates(tmp_path):
  pytest.importorskip("grpc_tools.protoc", reason="grpcio-tools is not installed")
  from importlib.metadata import version
  committed = (GRPC_DIR / "node_service_pb2_grpc.py").read_text()
  if f"GRPC_GENERATED_VERSION = '{version('grpcio-tools')}'" not in committed:
    pytest.skip(f"stubs were generated by another grpcio-tools than the installed {version('grpcio-tools')}")
  subprocess.run([sys.executable, "-m", "exo.networking.grpc.generate", str(tmp_path)], check=True, cwd=REPO)
  for name in ("node_service_pb2.py", "node_service_pb2_grpc.py"):
    assert filecmp.cmp(tmp_path / name, GRPC_DIR / name, shallow=False), f"{name} is stale: run python -m exo.networking.grpc.generate"


def test_method_paths_and_schema_names():
  service = pb.DESCRIPTOR.services_by_name["NodeService"]
  assert pb.DESCRIPTOR.package == "node_service"
  assert sorted(m.name for m in service.methods) == sorted(
    ["SendPrompt", "SendTensor", "SendExample", "CollectTopology", "SendResult", "SendOpaqueStatus", "HealthCheck"])
  fields = {f.name: (f.number, f.has_presence) for f in pb.PromptRequest.DESCRIPTOR.fields}
  assert fields == {"shard": (1, True), "prompt": (2, False), "request_id": (3, True), "inference_state": (4, True)}


# --- encodings ---

@pytest.mark.parametrize("array", [
  np.arange(2 * 3 * 8, dtype=np.float32).reshape(1, 6, 8) / 7,
  np.arange(16, dtype=np.float16).reshape(1, 2, 8),
  np.array([[42]], dtype=np.int64),
  np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3),
  np.array([3, 1], dtype=np.int32),
  np.zeros((0, 4), dtype=np.float32),
])
def test_tensor_round_trip(array):
  message = encode_tensor(array)
  assert message.tensor_data == array.tobytes() and list(message.shape) == list(array.shape) and message.dtype == str(array.dtype)
  back = decode_tensor(pb.Tensor.FromString(message.SerializeToString()))
  assert back.dtype == array.dtype and back.shape == array.shape and np.array_equal(back, array)
  back[...] = 0  # decoded arrays are writable copies


def test_non_contiguous_arrays_are_sent_in_c_order():
  array = np.arange(12, dtype=np.float32).reshape(3, 4).T
  assert np.array_equal(decode_tensor(encode_tensor(array)), array)


@pytest.mark.parametrize("tensor, why", [
  (pb.Tensor(tensor_data=b"\0" * 7, shape=[1, 2], dtype="float32"), "bytes"),
  (pb.Tensor(tensor_data=b"\0" * 4, shape=[1], dtype="bfloat16"), "dtype"),
  (pb.Tensor(tensor_data=b"\0" * 8, shape=[1], dtype="object"), "dtype"),
  (pb.Tensor(tensor_data=b"\0" * 8, shape=[1], dtype="no-such-type"), "dtype"),
  (pb.Tensor(tensor_data=b"", shape=[-1], dtype="float32"), "negative"),
])
def test_malformed_tensors_raise_value_error(tensor, why):
  with pytest.raises(ValueError, match=why):
    decode_tensor(tensor)


def test_empty_tensor_means_no_tensor():
  assert is_empty_tensor(pb.Tensor()) and not is_empty_tensor(encode_tensor(np.zeros((0,), np.float32)))


def test_inference_state_round_trip():
  state = {"cache": np.ones((2, 3), np.float16), "layers": [np.zeros(2, np.int64), np.ones(1, np.float32)], "step": 3,
           "meta": {"a": [1, 2]}, "empty_list": []}
  message = encode_inference_state(state)
  assert set(message.tensor_data) == {"cache"} and set(message.tensor_list_data) == {"layers"}
  assert json.loads(message.other_data_json) == {"step": 3, "meta": {"a": [1, 2]}, "empty_list": []}
  back = decode_inference_state(pb.InferenceState.FromString(message.SerializeToString()))
  assert set(back) == set(state) and np.array_equal(back["cache"], state["cache"]) and back["step"] == 3
  assert [a.dtype for a in back["layers"]] == [np.int64, np.float32]


def test_absent_and_empty_state_are_empty_dicts():
  assert decode_inference_state(None) == {} and decode_inference_state(pb.InferenceState()) == {}
  assert encode_inference_state({}).SerializeToString() == b"" and encode_inference_state(None).other_data_json == ""
  with pytest.raises(ValueError):
    decode_inference_state(pb.InferenceState(other_data_json="[1]"))


def caps(memory: int) -> DeviceCapabilities:
  return DeviceCapabilities(model="Linux Box", chip="CPU", memory=memory, flops=DeviceFlops(fp32=1.5, fp16=3.0, int8=6.0))


def test_topology_round_trip_keeps_edges_and_missing_descriptions():
  topology = Topology()
  topology.update_node("a", caps(1000))
  topology.update_node("b", caps(2000))
  topology.add_edge("a", "b", "MAN")
  topology.add_edge("b", "a")
  message = encode_topology(topology)
  assert not message.peer_graph["b"].connections[0].HasField("description")
  back = decode_topology(pb.Topology.FromString(message.SerializeToString()))
  assert back.nodes == topology.nodes
  assert {(c.from_id, c.to_id, c.description) for conns in back.peer_graph.values() for c in conns} == {("a", "b", "MAN"), ("b", "a", None)}


# --- channel options ---

def test_channel_options_match_upstream():
  options = dict(CHANNEL_OPTIONS)
  assert options["grpc.max_send_message_length"] == options["grpc.max_receive_message_length"] == 268435456
  assert options["grpc.max_metadata_size"] == 32 * 1024 * 1024
  assert options["grpc.keepalive_time_ms"] == 10000 and options["grpc.keepalive_timeout_ms"] == 5000
  assert options["grpc.keepalive_permit_without_calls"] == 1 and options["grpc.http2.max_pings_without_data"] == 0
  assert options["grpc.http2.min_time_between_pings_ms"] == 10000
  server = dict(SERVER_OPTIONS)
  # An upstream client pings every 10 s even while idle; the server must not answer that with GOAWAY.
  assert server["grpc.keepalive_permit_without_calls"] == 1 and server["grpc.http2.min_ping_interval_without_data_ms"] <= 10000
  assert server["grpc.http2.max_concurrent_streams"] == 0 and server["grpc.max_receive_message_length"] == 268435456


async def test_a_health_check_whose_stream_is_refused_counts_as_answered_and_a_failure_says_why(monkeypatch):
  """A loaded peer may refuse the check's stream (RST_STREAM code 7): its server is up, so the check passes, whether a
  resend gets through or not. Any other error fails it, and the handle keeps the reason for the error message."""
  monkeypatch.setattr(grpc_peer_handle, "REFUSED_RETRY_WAITS_S", (0, 0, None))
  refused = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 details="Stream removed (RST_STREAM (Received RST_STREAM with error code 7))")
  gone = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="Connection refused")
  peer = GRPCPeerHandle("p", "127.0.0.1:1", "MAN", None)
  peer._open_channel = lambda: None  # the stub below stands in for the channel (the refusal cannot be provoked on demand)
  answers = []

  class Stub:
    async def HealthCheck(self, request, **options):
      answer = answers.pop(0)
      if isinstance(answer, Exception):
        raise answer
      return pb.HealthCheckResponse(is_healthy=answer)
  peer.stub = Stub()
  answers[:] = [refused, True]
  assert await peer.health_check() and peer.health_failure is None and not answers
  answers[:] = [refused, refused, refused]
  assert await peer.health_check() and not answers
  answers[:] = [gone]
  assert not await peer.health_check() and peer.health_failure == "UNAVAILABLE: Connection refused"
  answers[:] = [False]
  assert not await peer.health_check() and peer.health_failure == "it said it is unhealthy"
  answers[:] = [True]
  assert await peer.health_check() and peer.health_failure is None


async def test_a_refused_stream_is_sent_again_and_other_errors_are_not(monkeypatch):
  """A peer over its per-connection stream limit refuses the stream (RST_STREAM code 7) without processing it; the
  call goes again. Anything else (here: a deadline) is the caller's to handle, sent once."""
  monkeypatch.setattr(grpc_peer_handle, "REFUSED_RETRY_WAITS_S", (0, 0, None))
  refused = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                 details="Stream removed (RST_STREAM (Received RST_STREAM with error code 7))")
  calls = []

  async def flaky(request, **options):
    calls.append(request)
    if len(calls) == 1:
      raise refused
    return "ok"
  assert await GRPCPeerHandle.unless_refused(flaky, "r") == "ok" and calls == ["r", "r"]

  async def always_refused(request, **options):
    calls.append(request)
    raise refused
  calls.clear()
  with pytest.raises(grpc.aio.AioRpcError):
    await GRPCPeerHandle.unless_refused(always_refused, "r")
  assert len(calls) == 3

  async def late(request, **options):
    calls.append(request)
    raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="late")
  calls.clear()
  with pytest.raises(grpc.aio.AioRpcError):
    await GRPCPeerHandle.unless_refused(late, "r")
  assert len(calls) == 1

"""Conversions between exo's Python objects and node_service messages (docs/architecture.md, "The ring protocol").

Decoders validate what they read and raise ValueError on malformed input, so the server can answer
INVALID_ARGUMENT instead of crashing a handler or corrupting a request."""
import json
import math
from typing import Optional

import numpy as np

from exo.inference.shard import Shard
from exo.networking.grpc import node_service_pb2 as pb
from exo.topology.device_capabilities import DeviceCapabilities, DeviceFlops
from exo.topology.topology import Topology

INT32_MAX = 2**31 - 1


# --- tensors ---

def encode_tensor(array: np.ndarray) -> pb.Tensor:
  array = np.ascontiguousarray(array)
  if str(array.dtype) == "bfloat16":  # peers rebuild with numpy.dtype(name), which has no bfloat16
    array = array.astype(np.float32)
  if array.dtype.kind not in "biuf":
    raise ValueError(f"cannot send a {array.dtype} array")
  return pb.Tensor(tensor_data=array.tobytes(), shape=array.shape, dtype=str(array.dtype))


def parse_dtype(name: str) -> np.dtype:
  """numpy's dtype for a wire name; only plain numeric and bool types are accepted (no objects, records, strings)."""
  try:
    dtype = np.dtype(name)
  except TypeError as e:
    raise ValueError(f"unknown dtype {name!r}") from e
  if dtype.kind not in "biuf" or dtype.names is not None or dtype.subdtype is not None:
    raise ValueError(f"unsupported dtype {name!r}")
  return dtype


def is_empty_tensor(tensor: pb.Tensor) -> bool:
  return not tensor.tensor_data and not tensor.shape and not tensor.dtype


def decode_tensor(tensor: pb.Tensor) -> np.ndarray:
  dtype = parse_dtype(tensor.dtype)
  shape = tuple(tensor.shape)
  if any(d < 0 for d in shape):
    raise ValueError(f"negative dimension in shape {shape}")
  expected = math.prod(shape) * dtype.itemsize
  if expected != len(tensor.tensor_data):
    raise ValueError(f"tensor of shape {shape} and dtype {dtype} needs {expected} bytes, got {len(tensor.tensor_data)}")
  # frombuffer gives a read-only view of the message's bytes; copy so engines may write in place.
  return np.frombuffer(tensor.tensor_data, dtype=dtype).reshape(shape).copy()


# --- inference state ---

def encode_inference_state(state: Optional[dict]) -> pb.InferenceState:
  message = pb.InferenceState()
  other = {}
  for key, value in (state or {}).items():
    if isinstance(value, np.ndarray):
      message.tensor_data[key].CopyFrom(encode_tensor(value))
    elif isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
      message.tensor_list_data[key].tensors.extend(encode_tensor(v) for v in value)
    else:
      other[key] = value
  if other:
    message.other_data_json = json.dumps(other)
  return message


def decode_inference_state(message: Optional[pb.InferenceState]) -> dict:
  """Absent and empty both mean {}."""
  if message is None:
    return {}
  state = {key: decode_tensor(t) for key, t in message.tensor_data.items()}
  state.update({key: [decode_tensor(t) for t in tl.tensors] for key, tl in message.tensor_list_data.items()})
  if message.other_data_json:
    try:
      other = json.loads(message.other_data_json)
    except ValueError as e:
      raise ValueError(f"inference state other_data_json is not JSON: {e}") from e
    if not isinstance(other, dict):
      raise ValueError("inference state other_data_json is not a JSON object")
    state.update(other)
  return state


# --- shards ---

def encode_shard(shard: Shard) -> pb.Shard:
  return pb.Shard(model_id=shard.model_id, start_layer=shard.start_layer, end_layer=shard.end_layer, n_layers=shard.n_layers)


def decode_shard(message: pb.Shard) -> Shard:
  if not message.model_id:
    raise ValueError("shard has no model_id")
  if message.n_layers <= 0:
    raise ValueError(f"shard of {message.model_id} has n_layers {message.n_layers}")
  if not 0 <= message.start_layer <= message.end_layer < message.n_layers:
    raise ValueError(f"shard layers {message.start_layer}-{message.end_layer} outside 0-{message.n_layers - 1}")
  return Shard(message.model_id, message.start_layer, message.end_layer, message.n_layers)


# --- topology ---

def encode_device_capabilities(caps: DeviceCapabilities) -> pb.DeviceCapabilities:
  return pb.DeviceCapabilities(model=caps.model, chip=caps.chip, memory=min(int(caps.memory), INT32_MAX),
                               flops=pb.DeviceFlops(fp32=caps.flops.fp32, fp16=caps.flops.fp16, int8=caps.flops.int8))


def decode_device_capabilities(message: pb.DeviceCapabilities) -> DeviceCapabilities:
  flops = message.flops
  return DeviceCapabilities(model=message.model, chip=message.chip, memory=message.memory,
                            flops=DeviceFlops(fp32=flops.fp32, fp16=flops.fp16, int8=flops.int8))


def encode_topology(topology: Topology) -> pb.Topology:
  message = pb.Topology()
  for node_id, caps in topology.nodes.items():
    message.nodes[node_id].CopyFrom(encode_device_capabilities(caps))
  for from_id, connections in topology.peer_graph.items():
    entry = message.peer_graph[from_id]
    for conn in sorted(connections, key=lambda c: c.to_id):
      edge = entry.connections.add(to_id=conn.to_id)
      if conn.description is not None:
        edge.description = conn.description
  return message


def decode_topology(message: pb.Topology) -> Topology:
  topology = Topology()
  for node_id, caps in message.nodes.items():
    topology.update_node(node_id, decode_device_capabilities(caps))
  for from_id, connections in message.peer_graph.items():
    for conn in connections.connections:
      topology.add_edge(from_id, conn.to_id, conn.description if conn.HasField("description") else None)
  return topology


"""The public Python API keeps upstream exo's shapes: each function a caller (or a plugin) uses is a coroutine
function or a plain one exactly as upstream declares it, and an engine written for upstream runs with every exo
capability at its default."""
import inspect
from unittest.mock import patch

import numpy as np
import pytest

from exo.download.shard_download import NoopShardDownloader, ShardDownloader
from exo.helpers import AsyncCallback, AsyncCallbackSystem
from exo.inference.dummy_inference_engine import DummyInferenceEngine
from exo.inference.inference_engine import InferenceEngine, get_inference_engine
from exo.inference.shard import Shard
from exo.networking.discovery import Discovery
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.networking.peer_handle import PeerHandle
from exo.networking.server import Server
from exo.orchestration.node import Node
from exo.topology import device_capabilities as caps_module
from exo.topology.topology import Topology

pytestmark = pytest.mark.unit

ASYNC, SYNC, PROPERTY = "async", "sync", "property"

# (owner, {member: shape}) as upstream declares them.
SHAPES = [
  (InferenceEngine, {"encode": ASYNC, "sample": ASYNC, "decode": ASYNC, "infer_tensor": ASYNC, "infer_prompt": ASYNC,
                     "load_checkpoint": ASYNC, "save_checkpoint": ASYNC, "save_session": ASYNC, "clear_session": ASYNC, "ensure_shard": ASYNC}),
  (DummyInferenceEngine, {"encode": ASYNC, "sample": ASYNC, "decode": ASYNC, "infer_tensor": ASYNC, "ensure_shard": ASYNC,
                          "load_checkpoint": ASYNC}),
  (Node, {"start": ASYNC, "stop": ASYNC, "process_prompt": ASYNC, "process_tensor": ASYNC, "process_inference_result": ASYNC,
          "forward_prompt": ASYNC, "forward_tensor": ASYNC, "get_partition_index": SYNC, "get_current_shard": SYNC, "update_peers": ASYNC,
          "collect_topology": ASYNC, "on_token": PROPERTY, "on_opaque_status": PROPERTY, "trigger_on_token_callbacks": SYNC,
          "broadcast_result": ASYNC, "broadcast_opaque_status": ASYNC, "current_topology": PROPERTY, "on_node_status": SYNC,
          "get_supported_inference_engines": SYNC, "broadcast_supported_engines": ASYNC, "get_topology_inference_engines": SYNC,
          "periodic_topology_collection": ASYNC}),
  (AsyncCallback, {"on_next": SYNC, "set": SYNC, "wait": ASYNC}),
  (AsyncCallbackSystem, {"register": SYNC, "deregister": SYNC, "trigger": SYNC, "trigger_all": SYNC}),
  (PeerHandle, {"id": SYNC, "addr": SYNC, "description": SYNC, "device_capabilities": SYNC, "connect": ASYNC, "is_connected": ASYNC,
                "disconnect": ASYNC, "health_check": ASYNC, "send_prompt": ASYNC, "send_tensor": ASYNC, "send_result": ASYNC,
                "collect_topology": ASYNC, "send_opaque_status": ASYNC}),
  (GRPCPeerHandle, {"connect": ASYNC, "is_connected": ASYNC, "disconnect": ASYNC, "health_check": ASYNC, "send_prompt": ASYNC,
                    "send_tensor": ASYNC, "send_result": ASYNC, "collect_topology": ASYNC, "send_opaque_status": ASYNC}),
  (Discovery, {"start": ASYNC, "stop": ASYNC, "discover_peers": ASYNC}),
  (Server, {"start": ASYNC, "stop": ASYNC}),
  (ShardDownloader, {"ensure_shard": ASYNC, "on_progress": PROPERTY}),
  (NoopShardDownloader, {"ensure_shard": ASYNC, "on_progress": PROPERTY}),
  (Topology, {"update_node": SYNC, "get_node": SYNC, "all_nodes": SYNC, "add_edge": SYNC, "merge": SYNC, "to_json": SYNC}),
  (caps_module, {"device_capabilities": ASYNC, "mac_device_capabilities": ASYNC, "linux_device_capabilities": ASYNC}),
]


def shape(owner, name: str) -> str:
  member = inspect.getattr_static(owner, name) if inspect.isclass(owner) else getattr(owner, name)
  if isinstance(member, property):
    return PROPERTY
  member = getattr(member, "__func__", member)  # staticmethod / classmethod
  return ASYNC if inspect.iscoroutinefunction(member) else SYNC


@pytest.mark.parametrize("owner, shapes", SHAPES, ids=[owner.__name__ for owner, _ in SHAPES])
def test_each_public_function_keeps_upstreams_sync_or_async_shape(owner, shapes):
  assert {name: shape(owner, name) for name in shapes} == shapes


SYSTEM_PROFILER = b"""Hardware:

    Hardware Overview:

      Model Name: MacBook Pro
      Model Identifier: Mac14,6
      Chip: Apple M2
      Total Number of Cores: 12 (8 performance and 4 efficiency)
      Memory: 32 GB
      System Firmware Version: 10151.1.1
"""


@patch("subprocess.check_output", return_value=SYSTEM_PROFILER)
async def test_mac_device_capabilities_is_awaited_and_reads_the_system_profiler(check_output):
  caps = await caps_module.mac_device_capabilities()
  assert (caps.model, caps.chip, caps.memory) == ("MacBook Pro", "Apple M2", 32 * 1024)
  assert caps.flops == caps_module.CHIP_FLOPS["Apple M2"]
  assert check_output.call_args.args[0] == ["system_profiler", "SPHardwareDataType"]


@patch("subprocess.check_output", return_value=SYSTEM_PROFILER)
async def test_device_capabilities_on_a_mac_comes_from_the_profiler(check_output, monkeypatch):
  monkeypatch.setattr(caps_module.platform, "system", lambda: "Darwin")
  assert (await caps_module.device_capabilities()).chip == "Apple M2"


class UpstreamStyleEngine(InferenceEngine):
  """An engine as upstream exo's contract asks for: the five abstract methods and nothing more."""

  async def encode(self, shard, prompt):
    return np.array([1, 2, 3])

  async def sample(self, x, temp=0.0, top_p=1.0):
    return np.array([int(np.argmax(x[0, -1]))])

  async def decode(self, shard, tokens):
    return "".join(map(str, tokens))

  async def infer_tensor(self, request_id, shard, input_data, inference_state=None):
    await self.ensure_shard(shard)
    return np.eye(4, dtype=np.float32)[None, :input_data.shape[1]], inference_state

  async def load_checkpoint(self, shard, path):
    await self.ensure_shard(shard)


async def test_an_upstream_style_engine_has_every_capability_at_its_default():
  engine, shard = UpstreamStyleEngine(), Shard("toy", 0, 0, 1)
  assert (engine.device_name, engine.context_length, engine.copies_prefixes, engine.reuses_prefixes) == ("CPU", None, False, False)
  assert engine.kv_cache_bytes() == engine.request_kv_bytes("r") == engine.prefix_cache_bytes() == 0
  assert engine.prefix_cache_state() == {"enabled": False}
  assert await engine.start_from_prefix("r", shard, ["k" * 24], 8) == 0
  logits, state = await engine.infer_prompt("r", shard, "hi", {"kept": 1})
  assert logits.shape == (1, 3, 4) and state == {"kept": 1} and engine.shard == shard
  [(batched, _)] = await engine.infer_batch(shard, [("r", np.array([[1, 2]]), None)])
  assert batched.shape == (1, 2, 4)
  await engine.save_session("k", "v")
  assert engine.session == {"k": "v"} and InferenceEngine.session == {}, "one engine's session is its own"
  await engine.clear_session()
  assert engine.session == {}


def test_get_inference_engine_is_importable_where_upstream_put_it():
  assert isinstance(get_inference_engine("dummy", NoopShardDownloader()), DummyInferenceEngine)
  with pytest.raises(ValueError, match="Unsupported inference engine: nope"):
    get_inference_engine("nope", NoopShardDownloader())

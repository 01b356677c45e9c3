"""Discovery with real peers answering: Tailscale against a local fake of its HTTP API (the real one is not reachable
from here) with a real gRPC peer, and two real `exo` nodes finding each other by UDP broadcast inside a network
namespace this test creates (so no datagram ever reaches a real interface)."""
import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from aiohttp import web

from exo.helpers import AsyncCallbackSystem
from exo.inference.dummy_inference_engine import DummyInferenceEngine
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.networking.grpc.grpc_server import GRPCServer
from exo.networking.tailscale.tailscale_discovery import TailscaleDiscovery
from exo.topology.device_capabilities import DeviceCapabilities, DeviceFlops
from exo.topology.topology import Topology
from tests.support.cluster import ExoProcess, free_port
from tests.support.waiting import eventually

pytestmark = pytest.mark.cluster


class FakeTailscale:
  """Just the routes discovery uses: device list, device attributes, attribute writes."""

  def __init__(self):
    self.devices = []
    self.attributes = {}
    self.posted = {}
    self.auth = set()
    app = web.Application()
    app.router.add_get("/api/v2/tailnet/{tailnet}/devices", self.list_devices)
    app.router.add_get("/api/v2/device/{device}/attributes", self.get_attributes)
    app.router.add_post("/api/v2/device/{device}/attributes/{name}", self.set_attribute)
    self.runner = web.AppRunner(app)

  async def start(self) -> str:
    await self.runner.setup()
    port = free_port()
    await web.TCPSite(self.runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}"

  async def list_devices(self, request):
    self.auth.add(request.headers.get("Authorization"))
    assert request.match_info["tailnet"] == "example.ts.net"
    return web.json_response({"devices": self.devices})

  async def get_attributes(self, request):
    return web.json_response({"attributes": self.attributes.get(request.match_info["device"], {})})

  async def set_attribute(self, request):
    self.posted.setdefault(request.match_info["device"], {})[request.match_info["name"]] = (await request.json())["value"]
    return web.json_response({})


def iso_ago(seconds: float) -> str:
  return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - seconds))


class HealthOnlyNode:
  inference_engine = DummyInferenceEngine()
  on_opaque_status = AsyncCallbackSystem()
  current_topology = Topology()


async def test_tailscale_publishes_itself_and_finds_healthy_recent_peers():
  fake = FakeTailscale()
  base_url = await fake.start()
  peer_port = free_port()
  peer_server = GRPCServer(HealthOnlyNode(), "127.0.0.1", peer_port)
  await peer_server.start()
  published = {"custom:exo_node_id": "peer_node", "custom:exo_node_port": str(peer_port), "custom:exo_device_capability_chip": "Apple_M2",
               "custom:exo_device_capability_model": "MacBook_Pro", "custom:exo_device_capability_memory": "16384",
               "custom:exo_device_capability_flops_fp16": "7.1", "custom:exo_device_capability_flops_fp32": "3.55",
               "custom:exo_device_capability_flops_int8": "14.2"}
  fake.devices = [
    {"nodeId": "nSELF", "name": "my-laptop", "addresses": ["127.0.0.1"], "lastSeen": iso_ago(1)},
    {"nodeId": "nPEER", "name": "peer-box", "addresses": ["127.0.0.1", "fd7a::1"], "lastSeen": iso_ago(2)},
    {"nodeId": "nOLD", "name": "old-box", "addresses": ["127.0.0.1"], "lastSeen": iso_ago(3600)},
    {"nodeId": "nPLAIN", "name": "printer", "addresses": ["127.0.0.1"], "lastSeen": iso_ago(1)},
  ]
  fake.attributes = {"nPEER": published, "nOLD": dict(published, **{"custom:exo_node_id": "old_node"}),
                     "nSELF": {"custom:exo_node_id": "my_node", "custom:exo_node_port": "1"}}
  caps = DeviceCapabilities(model="Linux Box (Device: CPU)", chip="Unknown Chip (Device: CPU)", memory=24000, flops=DeviceFlops(fp32=0, fp16=0, int8=0))
  discovery = TailscaleDiscovery("my-node", 50123, GRPCPeerHandle, discovery_interval=0.1, update_interval=0.1, device_capabilities=caps,
                                 tailscale_api_key="tskey-test", tailnet="example.ts.net", api_base_url=base_url, device_id="nSELF")
  await discovery.start()
  try:
    peers = await asyncio.wait_for(discovery.discover_peers(1), 10)
    assert [(p.id(), p.addr(), p.description()) for p in peers] == [("peer-node", f"127.0.0.1:{peer_port}", "TS")]
    assert peers[0].device_capabilities() == DeviceCapabilities(model="MacBook Pro", chip="Apple M2", memory=16384,
                                                                flops=DeviceFlops(fp32=3.55, fp16=7.1, int8=14.2))
    assert fake.auth == {"Bearer tskey-test"}
    assert fake.posted["nSELF"] == {
      "custom:exo_node_id": "my_node", "custom:exo_node_port": "50123", "custom:exo_device_capability_chip": "Unknown_Chip__Device__CPU_",
      "custom:exo_device_capability_model": "Linux_Box__Device__CPU_", "custom:exo_device_capability_memory": "24000",
      "custom:exo_device_capability_flops_fp16": "0.0", "custom:exo_device_capability_flops_fp32": "0.0", "custom:exo_device_capability_flops_int8": "0.0"}
    await peer_server.stop()  # the peer goes away: expired by the health check
    await eventually(lambda: discovery.known_peers == {}, 10)
  finally:
    await discovery.stop()
    await peer_server.stop()
    await fake.runner.cleanup()


@pytest.fixture
def netns():
  """A fresh network namespace with only its own loopback up: broadcasts there reach nothing else."""
  if os.geteuid() != 0 or shutil.which("ip") is None:
    pytest.skip("needs root and iproute2 to create a network namespace")
  name = f"exotest-{uuid.uuid4().hex[:8]}"
  if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode != 0:
    pytest.skip("cannot create a network namespace here")
  try:
    subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
    yield name
  finally:
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


async def test_two_nodes_find_each_other_by_udp_broadcast_with_crossed_ports(netns, tmp_path):
  in_ns = ["ip", "netns", "exec", netns]
  env = {"DEBUG": "7", "DEBUG_DISCOVERY": "7"}
  api_ports = {"node1": 52001, "node2": 52002}  # a fresh namespace: every port is free
  nodes = [ExoProcess(node_id, ["--inference-engine", "dummy", "--node-port", str(grpc_port), "--listen-port", listen, "--broadcast-port", broadcast,
                                "--chatgpt-api-port", str(api_ports[node_id]), "--disable-tui"], tmp_path, env, prefix=in_ns)
           for node_id, grpc_port, listen, broadcast in (("node1", 51001, "5678", "5679"), ("node2", 51002, "5679", "5678"))]
  try:
    for node in nodes:
      node.start()
    await nodes[0].wait_for_log(r"^Peer statuses: \{'node2': 'is_connected=True, health_check=True", 60)
    await nodes[1].wait_for_log(r"^Peer statuses: \{'node1': 'is_connected=True, health_check=True", 60)
    await nodes[0].wait_for_log(r"^exo 0\.0\.1: node node1", 30)
    # One chat through the API inside the namespace goes round the two-node ring.
    ask = ("import json, urllib.request; body = json.dumps({'model': 'dummy', 'messages': [{'role': 'user', 'content': 'hi'}]}).encode(); "
           f"r = urllib.request.urlopen(urllib.request.Request('http://127.0.0.1:{api_ports['node1']}/v1/chat/completions', body, "
           "{'Content-Type': 'application/json'}), timeout=30); print(json.load(r)['choices'][0]['message']['content'])")
    tries = []

    def answered() -> bool:  # the ring may still be settling its topology on the first try
      tries.append(subprocess.run(in_ns + [sys.executable, "-c", ask], capture_output=True, text=True, timeout=60))
      return tries[-1].stdout.strip() == "dummy" * 10
    await eventually(answered, 30, lambda: f"a chat answered: {tries[-1].stderr}", interval=0.5)
    for node in nodes:
      assert "Failed to connect peers:" not in node.log()
      assert re.search(r"Adding peer node\d at 127\.0\.0\.1:5100\d \(Loopback \(lo\)\)", node.log())
  finally:
    for node in nodes:
      node.stop()

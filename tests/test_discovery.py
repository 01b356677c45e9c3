"""Discovery modules (docs/architecture.md, "The ring"): manual config validation and hot reload, UDP datagram
handling and expiry, Tailscale's settings. (With real peers answering: test_discovery_networked.py.)"""
import asyncio
import json
import logging
import os
import re

import pytest

from exo.logs import DISCOVERY
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.networking.manual.manual_discovery import ManualDiscovery
from exo.networking.tailscale.tailscale_discovery import TailscaleDiscovery
from exo.networking.udp.interfaces import priority_by_name
from exo.networking.udp.udp_discovery import UDPDiscovery, subnet_broadcast_address
from exo.topology.device_capabilities import DeviceCapabilities, DeviceFlops
from tests.support.cluster import device_caps, write_manual_config

pytestmark = pytest.mark.unit


class FakePeer:
  """A PeerHandle whose health the test decides."""
  healthy = {}  # address -> bool; absent means healthy
  created = []

  def __init__(self, peer_id, address, description, caps):
    self._id, self._address, self._description, self._caps = peer_id, address, description, caps
    self.connected = False
    FakePeer.created.append(self)

  def id(self): return self._id
  def addr(self): return self._address
  def description(self): return self._description
  def device_capabilities(self): return self._caps
  async def connect(self): self.connected = True
  async def is_connected(self): return self.connected
  async def disconnect(self): self.connected = False

  async def health_check(self):
    await asyncio.sleep(0.01)  # a real check yields to the loop: twin datagrams overlap
    return FakePeer.healthy.get(self._address, True)


@pytest.fixture(autouse=True)
def fresh_fake_peers():
  FakePeer.healthy, FakePeer.created = {}, []


# --- manual ---

def test_manual_config_errors_follow_the_spec(tmp_path):
  missing = tmp_path / "missing.json"
  with pytest.raises(FileNotFoundError, match=re.escape(f"Config file not found at {missing}")):
    ManualDiscovery(str(missing), "node1", FakePeer)
  empty = tmp_path / "empty.json"
  empty.write_text("")
  with pytest.raises(ValueError) as error:
    ManualDiscovery(str(empty), "node1", FakePeer)
  assert str(error.value).startswith(f"Error validating network topology config from {empty}: ")
  assert "Invalid JSON: EOF while parsing a value at line 1 column 0" in str(error.value)
  no_port = tmp_path / "no_port.json"
  no_port.write_text(json.dumps({"peers": {"node1": {"address": "127.0.0.1", "device_capabilities": device_caps()}}}))
  with pytest.raises(ValueError) as error:
    ManualDiscovery(str(no_port), "node1", FakePeer)
  assert "port" in str(error.value) and "  Field required" in str(error.value)
  no_flops = tmp_path / "no_flops.json"
  caps = device_caps()
  del caps["flops"]["int8"]
  no_flops.write_text(json.dumps({"peers": {"node1": {"address": "h", "port": 1, "device_capabilities": caps}}}))
  with pytest.raises(ValueError, match="int8"):
    ManualDiscovery(str(no_flops), "node1", FakePeer)


def bump_mtime(path):
  stat = os.stat(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))


async def test_manual_peers_are_the_healthy_others_and_the_file_reloads_by_mtime(tmp_path, caplog):
  config = write_manual_config(tmp_path / "peers.json", {"me": 1, "a": 2, "b": 3})
  FakePeer.healthy = {"127.0.0.1:3": False}
  discovery = ManualDiscovery(str(config), "me", FakePeer, poll_interval=3600)
  await discovery.start()
  try:
    peers = await asyncio.wait_for(discovery.discover_peers(1), 5)
    assert [(p.id(), p.addr(), p.description()) for p in peers] == [("a", "127.0.0.1:2", "MAN")]
    assert peers[0].device_capabilities() == DeviceCapabilities(**device_caps())
    FakePeer.healthy = {}
    await discovery.poll_once()
    assert sorted(p.id() for p in await discovery.discover_peers()) == ["a", "b"]
    handle_a = discovery.known_peers["a"]

    write_manual_config(config, {"me": 1, "a": 2, "c": 4})  # b gone, c new
    bump_mtime(config)
    await discovery.poll_once()
    assert sorted(discovery.known_peers) == ["a", "c"] and discovery.known_peers["a"] is handle_a  # kept while healthy

    config.write_text("{ broken")
    bump_mtime(config)
    await discovery.poll_once()
    assert sorted(discovery.known_peers) == ["a", "c"]
    assert "Error validating network topology config" in caplog.text

    write_manual_config(config, {"a": 2, "c": 4})  # own id missing: logged, last good set kept
    bump_mtime(config)
    await discovery.poll_once()
    assert sorted(discovery.known_peers) == ["a", "c"] and "Node ID me not found in config file" in caplog.text

    FakePeer.healthy = {"127.0.0.1:2": False}
    await discovery.poll_once()
    assert sorted(discovery.known_peers) == ["a", "c"]  # one missed round is forgiven
    FakePeer.healthy = {}
    await discovery.poll_once()
    FakePeer.healthy = {"127.0.0.1:2": False}
    await discovery.poll_once()
    assert sorted(discovery.known_peers) == ["a", "c"] and discovery.known_peers["a"] is handle_a  # the count restarted
    await discovery.poll_once()
    assert sorted(discovery.known_peers) == ["c"]  # two in a row: it leaves
    FakePeer.healthy = {}
    await discovery.poll_once()
    assert discovery.known_peers["a"] is not handle_a  # readmitted with a fresh handle: the node closed the old one
  finally:
    await discovery.stop()


async def test_manual_discovery_polls_in_the_background(tmp_path):
  config = write_manual_config(tmp_path / "peers.json", {"me": 1, "a": 2})
  FakePeer.healthy = {"127.0.0.1:2": False}
  discovery = ManualDiscovery(str(config), "me", FakePeer, poll_interval=0.05)
  await discovery.start()
  try:
    assert discovery.known_peers == {}
    FakePeer.healthy = {}
    assert [p.id() for p in await asyncio.wait_for(discovery.discover_peers(1), 5)] == ["a"]
  finally:
    await discovery.stop()


# --- UDP (datagram handling; no socket is opened here) ---

CAPS = DeviceCapabilities(model="Linux Box", chip="CPU", memory=16384, flops=DeviceFlops(fp32=1.0, fp16=2.0, int8=4.0))


def udp(**kwargs) -> UDPDiscovery:
  return UDPDiscovery("me", 50000, 5678, 5679, FakePeer, device_capabilities=CAPS, **kwargs)


def datagram(node_id="peer", port=50001, priority=4, interface_type="Ethernet", interface_name="eth0", **extra) -> bytes:
  message = {"type": "discovery", "node_id": node_id, "grpc_port": port, "device_capabilities": CAPS.to_dict(),
             "priority": priority, "interface_name": interface_name, "interface_type": interface_type, **extra}
  return json.dumps(message).encode()


def test_announcement_is_the_upstream_datagram():
  message = udp().announcement("eth1")
  assert message == json.dumps({"type": "discovery", "node_id": "me", "grpc_port": 50000,
                                "device_capabilities": {"model": "Linux Box", "chip": "CPU", "memory": 16384, "flops": {"fp32": 1.0, "fp16": 2.0, "int8": 4.0}},
                                "priority": 4, "interface_name": "eth1", "interface_type": "Ethernet"})


@pytest.mark.parametrize("name, expected", [
  ("docker0", (7, "Container Virtual")), ("br-1a2b", (7, "Container Virtual")), ("veth12", (7, "Container Virtual")),
  ("mybridge", (7, "Container Virtual")), ("lo", (6, "Loopback")), ("lo0", (6, "Loopback")), ("tb0", (5, "Thunderbolt")),
  ("eth0", (4, "Ethernet")), ("enp3s0", (4, "Ethernet")), ("en2", (4, "Ethernet")), ("en0", (3, "WiFi")), ("en1", (3, "WiFi")),
  ("wlan0", (3, "WiFi")), ("wlp2s0", (3, "WiFi")), ("tun0", (1, "External Virtual")), ("utun3", (1, "External Virtual")),
  ("tailscale0", (2, "Other")),
])
def test_interface_priorities(name, expected):
  assert priority_by_name(name) == expected


def test_subnet_broadcast_assumes_a_slash_24():
  assert subnet_broadcast_address("10.1.2.3") == "10.1.2.255" and subnet_broadcast_address("127.0.0.1") == "127.0.0.255"


async def test_udp_admits_a_healthy_sender_once_even_from_twin_datagrams():
  discovery = udp()
  await asyncio.gather(discovery.handle_datagram(datagram(), ("192.0.2.7", 5678)), discovery.handle_datagram(datagram(), ("192.0.2.7", 5678)))
  assert len(FakePeer.created) == 1
  handle = (await discovery.discover_peers())[0]
  assert (handle.id(), handle.addr(), handle.description(), handle.device_capabilities()) == ("peer", "192.0.2.7:50001", "Ethernet (eth0)", CAPS)
  await discovery.handle_datagram(datagram(), ("192.0.2.7", 5678))  # known, same address: only refreshed
  assert len(FakePeer.created) == 1 and discovery.known_peers["peer"].handle is handle


@pytest.mark.parametrize("data, kwargs", [
  (b"not json", {}),
  (b'"a string"', {}),
  (datagram(type="something_else"), {}),
  (datagram(node_id="me"), {}),
  (datagram(node_id="stranger"), {"allowed_node_ids": ["friend"]}),
  (datagram(interface_type="WiFi"), {"allowed_interface_types": ["Ethernet"]}),
  (datagram(grpc_port="nope"), {}),
  (b"\xff\xfe", {}),
])
async def test_udp_ignores_what_it_must(data, kwargs):
  discovery = udp(**kwargs)
  await discovery.handle_datagram(data, ("192.0.2.7", 5678))
  assert discovery.known_peers == {} and FakePeer.created == []


async def test_udp_requires_a_passing_health_check_and_prefers_better_interfaces():
  discovery = udp()
  FakePeer.healthy = {"192.0.2.7:50001": False}
  await discovery.handle_datagram(datagram(priority=3, interface_type="WiFi"), ("192.0.2.7", 5678))
  assert discovery.known_peers == {}
  FakePeer.healthy = {}
  await discovery.handle_datagram(datagram(priority=3, interface_type="WiFi"), ("192.0.2.7", 5678))
  await discovery.handle_datagram(datagram(priority=2), ("198.51.100.7", 5678))  # worse interface: ignored
  assert discovery.known_peers["peer"].handle.addr() == "192.0.2.7:50001"
  await discovery.handle_datagram(datagram(priority=5, interface_type="Thunderbolt"), ("198.51.100.7", 5678))  # better: switch
  assert discovery.known_peers["peer"].handle.addr() == "198.51.100.7:50001"
  FakePeer.healthy = {"198.51.100.7:50001": False}
  await discovery.handle_datagram(datagram(priority=5), ("198.51.100.7", 5678))  # known address, now unhealthy: removed
  assert discovery.known_peers == {}


async def test_udp_cleanup_expires_quiet_or_unhealthy_peers_and_logs_statuses(caplog):
  caplog.set_level(logging.DEBUG, logger=DISCOVERY)  # as DEBUG_DISCOVERY=2
  discovery = udp(discovery_timeout=30)
  for name, address in (("quiet", "192.0.2.1"), ("sick", "192.0.2.2"), ("fine", "192.0.2.3")):
    await discovery.handle_datagram(datagram(node_id=name), (address, 5678))
  for peer in discovery.known_peers.values():
    await peer.handle.connect()
  discovery.known_peers["quiet"].last_seen -= 31
  FakePeer.healthy = {"192.0.2.2:50001": False}
  await discovery.cleanup_once()
  assert sorted(discovery.known_peers) == ["fine"]
  out = "\n".join(r.getMessage() for r in caplog.records)
  assert re.search(r"^Peer statuses: \{.*'fine': 'is_connected=True, health_check=True", out, re.M)


def test_tailscale_needs_key_and_tailnet():
  with pytest.raises(ValueError, match="--tailscale-api-key"):
    TailscaleDiscovery("n", 1, GRPCPeerHandle)

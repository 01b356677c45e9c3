"""Peer discovery by UDP broadcast on the local network, the default module (docs/architecture.md, "The ring protocol").

Each node announces itself every `broadcast_interval` seconds on every local IPv4 address and admits a sender
as a peer only after a passing gRPC health check; a cleanup loop drops peers that go quiet or unhealthy."""
import asyncio
import json
import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set

from exo.logs import DISCOVERY, VERBOSE, level_of
from exo.networking.discovery import Discovery
from exo.networking.peer_handle import PeerHandle
from exo.networking.udp.interfaces import interface_priority_and_type, local_ipv4_addresses
from exo.topology.device_capabilities import UNKNOWN_DEVICE_CAPABILITIES, DeviceCapabilities

log = logging.getLogger(__name__)
discovery_log = logging.getLogger(DISCOVERY)


@dataclass
class KnownPeer:
  handle: PeerHandle
  connected_at: float
  last_seen: float
  priority: int


class _Listener(asyncio.DatagramProtocol):
  def __init__(self, on_datagram: Callable[[bytes, tuple], None]):
    self.on_datagram = on_datagram

  def datagram_received(self, data: bytes, addr: tuple) -> None:
    self.on_datagram(data, addr)


def subnet_broadcast_address(ip: str) -> str:
  """<a>.<b>.<c>.255: upstream assumes a /24 whatever the real netmask, and so must we to reach it."""
  a, b, c, _ = socket.gethostbyname(ip).split(".")
  return f"{a}.{b}.{c}.255"


class UDPDiscovery(Discovery):
  def __init__(self, node_id: str, node_port: int, listen_port: int, broadcast_port: int,
               create_peer_handle: Callable[[str, str, str, DeviceCapabilities], PeerHandle], broadcast_interval: float = 2.5,
               discovery_timeout: int = 30, device_capabilities: DeviceCapabilities = UNKNOWN_DEVICE_CAPABILITIES,
               allowed_node_ids: Optional[List[str]] = None, allowed_interface_types: Optional[List[str]] = None):
    self.node_id = node_id
    self.node_port = node_port
    self.listen_port = listen_port
    self.broadcast_port = broadcast_port
    self.create_peer_handle = create_peer_handle
    self.broadcast_interval = broadcast_interval
    self.discovery_timeout = discovery_timeout
    self.device_capabilities = device_capabilities
    self.allowed_node_ids = allowed_node_ids
    self.allowed_interface_types = allowed_interface_types
    self.known_peers: Dict[str, KnownPeer] = {}
    self._admitting: Set[str] = set()  # ids with a health check in flight: one admission at a time per id
    self._tasks: List[asyncio.Task] = []
    self._datagram_tasks: Set[asyncio.Task] = set()
    self._transport: Optional[asyncio.DatagramTransport] = None

  async def start(self) -> None:
    loop = asyncio.get_running_loop()
    self._transport, _ = await loop.create_datagram_endpoint(
      lambda: _Listener(self._on_datagram), local_addr=("0.0.0.0", self.listen_port), reuse_port=hasattr(socket, "SO_REUSEPORT"))
    self._tasks = [asyncio.create_task(self._task_broadcast()), asyncio.create_task(self._task_cleanup())]

  async def stop(self) -> None:
    tasks = self._tasks + list(self._datagram_tasks)
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    self._tasks = []
    if self._transport is not None:
      self._transport.close()
      self._transport = None

  async def discover_peers(self, wait_for_peers: int = 0) -> List[PeerHandle]:
    while len(self.known_peers) < wait_for_peers:
      discovery_log.debug("Waiting for peers: %d/%d", len(self.known_peers), wait_for_peers)
      await asyncio.sleep(0.1)
    return [peer.handle for peer in self.known_peers.values()]

  # --- sending ---

  def announcement(self, interface_name: str) -> str:
    priority, interface_type = interface_priority_and_type(interface_name)
    return json.dumps({
      "type": "discovery", "node_id": self.node_id, "grpc_port": self.node_port,
      "device_capabilities": self.device_capabilities.to_dict(),
      "priority": priority, "interface_name": interface_name, "interface_type": interface_type,
    })

  def broadcast_once(self) -> None:
    for ip, interface_name in local_ipv4_addresses():
      message = self.announcement(interface_name).encode("utf-8")
      try:
        targets = [subnet_broadcast_address(ip), "255.255.255.255"]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
          sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
          sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
          if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
          sock.bind((ip, 0))
          for target in targets:
            try:
              sock.sendto(message, (target, self.broadcast_port))
            except OSError as e:  # e.g. no route for the global broadcast on this interface
              discovery_log.log(level_of(3), "Broadcast from %s (%s) to %s failed: %r", ip, interface_name, target, e)
      except OSError as e:
        discovery_log.debug("Cannot broadcast from %s (%s): %r", ip, interface_name, e)

  async def _task_broadcast(self) -> None:
    while True:
      self.broadcast_once()
      await asyncio.sleep(self.broadcast_interval)

  # --- receiving ---

  def _on_datagram(self, data: bytes, addr: tuple) -> None:
    task = asyncio.create_task(self.handle_datagram(data, addr))
    self._datagram_tasks.add(task)
    task.add_done_callback(self._datagram_tasks.discard)

  def _ignore(self, why: str, data) -> None:
    discovery_log.debug("Ignoring datagram (%s): %.200r", why, data)

  async def handle_datagram(self, data: bytes, addr: tuple) -> None:
    try:
      text = data.decode("utf-8").strip()
      message = json.loads(text) if text[:1] in ("{", "[") else None
    except (UnicodeDecodeError, ValueError):
      message = None
    if not isinstance(message, dict):
      return self._ignore("not a JSON object", data)
    if message.get("type") != "discovery":
      return self._ignore("not a discovery message", data)
    peer_id = message.get("node_id")
    if not isinstance(peer_id, str) or peer_id == self.node_id:
      return  # our own announcement, echoed back by the broadcast
    if self.allowed_node_ids and peer_id not in self.allowed_node_ids:
      return self._ignore(f"node id {peer_id} not in --node-id-filter", data)
    if self.allowed_interface_types and message.get("interface_type") not in self.allowed_interface_types:
      return self._ignore(f"interface type {message.get('interface_type')} not in --interface-type-filter", data)
    try:
      peer_address = f"{addr[0]}:{int(message['grpc_port'])}"
      caps = DeviceCapabilities(**message["device_capabilities"])
      priority = int(message.get("priority", 1))
    except (KeyError, TypeError, ValueError) as e:
      return self._ignore(f"malformed: {e!r}", data)
    description = f"{message.get('interface_type')} ({message.get('interface_name')})"
    known = self.known_peers.get(peer_id)
    if known is None or known.handle.addr() != peer_address:
      if known is not None and known.priority >= priority:
        return  # already reached through an interface at least as good
      if peer_id in self._admitting:
        return  # the twin datagram (subnet + global broadcast) is being handled
      self._admitting.add(peer_id)
      try:
        handle = self.create_peer_handle(peer_id, peer_address, description, caps)
        if not await handle.health_check():
          discovery_log.debug("Peer %s at %s failed its health check; not admitted", peer_id, peer_address)
          return
        now = time.time()
        log.log(VERBOSE, "Adding peer %s at %s (%s), priority %s", peer_id, peer_address, description, priority)
        self.known_peers[peer_id] = KnownPeer(handle, now, now, priority)
      finally:
        self._admitting.discard(peer_id)
    else:
      if await known.handle.health_check():
        known.last_seen, known.priority = time.time(), priority
      elif self.known_peers.get(peer_id) is known:
        discovery_log.log(VERBOSE, "Peer %s at %s is unhealthy; removed", peer_id, peer_address)
        del self.known_peers[peer_id]

  # --- expiry ---

  async def _task_cleanup(self) -> None:
    while True:
      try:
        await self.cleanup_once()
      except Exception as e:
        discovery_log.log(VERBOSE, "Error in peer cleanup: %r", e)
      await asyncio.sleep(self.broadcast_interval)

  async def cleanup_once(self) -> None:
    now = time.time()
    peers = list(self.known_peers.items())
    connected = await asyncio.gather(*[p.handle.is_connected() for _, p in peers])
    healthy = await asyncio.gather(*[p.handle.health_check() for _, p in peers])
    statuses = {}
    for (peer_id, peer), is_connected, health_ok in zip(peers, connected, healthy):
      statuses[peer_id] = (f"is_connected={is_connected}, health_check={health_ok}, connected_at={peer.connected_at}, "
                           f"last_seen={peer.last_seen}, priority={peer.priority}")
      stale = now - peer.last_seen > self.discovery_timeout
      never_connected = not is_connected and now - peer.connected_at > self.discovery_timeout
      if (stale or never_connected or not health_ok) and self.known_peers.get(peer_id) is peer:
        discovery_log.log(VERBOSE, "Removing peer %s@%s: stale=%s, never_connected=%s, healthy=%s", peer_id, peer.handle.addr(), stale, never_connected, health_ok)
        del self.known_peers[peer_id]
    discovery_log.debug("Peer statuses: %s", statuses)

"""Peers from a Tailscale tailnet: each node publishes its exo id, port and capabilities as custom
device attributes, and reads everyone else's from the device list; peers are admitted after a health check."""
import asyncio
import logging
import re
import time
from typing import Callable, Dict, List, Optional, Tuple

from exo.logs import DISCOVERY, VERBOSE
from exo.networking.discovery import Discovery
from exo.networking.peer_handle import PeerHandle
from exo.networking.tailscale.tailscale_api import DEFAULT_BASE_URL, TailscaleAPI, own_device_id, seconds_since
from exo.topology.device_capabilities import UNKNOWN_DEVICE_CAPABILITIES, DeviceCapabilities, DeviceFlops

log = logging.getLogger(__name__)
discovery_log = logging.getLogger(DISCOVERY)

DESCRIPTION = "TS"
ATTR = "custom:exo_"
ATTR_NODE_ID, ATTR_PORT = f"{ATTR}node_id", f"{ATTR}node_port"
ATTR_CHIP, ATTR_MODEL, ATTR_MEMORY = f"{ATTR}device_capability_chip", f"{ATTR}device_capability_model", f"{ATTR}device_capability_memory"
ATTR_FLOPS = {kind: f"{ATTR}device_capability_flops_{kind}" for kind in ("fp16", "fp32", "int8")}


def sanitize(value: str) -> str:
  """Attribute values allow only [A-Za-z0-9_.], at most 50 characters."""
  return re.sub(r"[^A-Za-z0-9_.]", "_", value)[:50]


def published_attributes(node_id: str, node_port: int, caps: DeviceCapabilities) -> Dict[str, str]:
  values = {
    ATTR_NODE_ID: node_id.replace("-", "_"), ATTR_PORT: str(node_port),
    ATTR_CHIP: sanitize(caps.chip), ATTR_MODEL: sanitize(caps.model), ATTR_MEMORY: str(caps.memory),
    **{ATTR_FLOPS[kind]: str(getattr(caps.flops, kind)) for kind in ATTR_FLOPS},
  }
  return {name: value.replace(" ", "_") for name, value in values.items()}


def read_attributes(attributes: Dict[str, object]) -> Optional[Tuple[str, int, DeviceCapabilities]]:
  """(node id, port, capabilities) an exo node published, or None for devices that run no exo node."""
  if ATTR_NODE_ID not in attributes or ATTR_PORT not in attributes:
    return None
  text = lambda name, default="": str(attributes.get(name, default))
  number = lambda name: float(attributes.get(name, 0) or 0)
  caps = DeviceCapabilities(model=text(ATTR_MODEL, "Unknown Model").replace("_", " "), chip=text(ATTR_CHIP, "Unknown Chip").replace("_", " "),
                            memory=int(number(ATTR_MEMORY)), flops=DeviceFlops(**{kind: number(name) for kind, name in ATTR_FLOPS.items()}))
  return text(ATTR_NODE_ID).replace("_", "-"), int(number(ATTR_PORT)), caps


class TailscaleDiscovery(Discovery):
  def __init__(self, node_id: str, node_port: int, create_peer_handle: Callable[[str, str, str, DeviceCapabilities], PeerHandle],
               discovery_interval: float = 5, discovery_timeout: float = 30, update_interval: float = 15,
               device_capabilities: DeviceCapabilities = UNKNOWN_DEVICE_CAPABILITIES, tailscale_api_key: Optional[str] = None,
               tailnet: Optional[str] = None, allowed_node_ids: Optional[List[str]] = None,
               api_base_url: str = DEFAULT_BASE_URL, device_id: Optional[str] = None):
    if not tailscale_api_key or not tailnet:
      raise ValueError("Tailscale discovery needs --tailscale-api-key and --tailnet-name")
    self.node_id = node_id
    self.node_port = node_port
    self.create_peer_handle = create_peer_handle
    self.discovery_interval = discovery_interval
    self.discovery_timeout = discovery_timeout
    self.update_interval = update_interval
    self.device_capabilities = device_capabilities
    self.tailnet = tailnet
    self.allowed_node_ids = allowed_node_ids
    self.api = TailscaleAPI(tailscale_api_key, api_base_url)
    self.device_id = device_id  # None: asked of the local `tailscale` CLI at start
    self.known_peers: Dict[str, Tuple[PeerHandle, float, float]] = {}  # id -> (handle, connected_at, last_seen)
    self._tasks: List[asyncio.Task] = []

  async def start(self) -> None:
    if self.device_id is None:
      self.device_id = await own_device_id()
    self._tasks = [asyncio.create_task(self._every(self.update_interval, self.publish)),
                   asyncio.create_task(self._every(self.discovery_interval, self.discover_once)),
                   asyncio.create_task(self._every(self.discovery_interval, self.cleanup_once))]

  async def stop(self) -> None:
    for task in self._tasks:
      task.cancel()
    await asyncio.gather(*self._tasks, return_exceptions=True)
    self._tasks = []
    await self.api.close()

  async def discover_peers(self, wait_for_peers: int = 0) -> List[PeerHandle]:
    while len(self.known_peers) < wait_for_peers:
      await asyncio.sleep(0.1)
    return [handle for handle, _, _ in self.known_peers.values()]

  async def _every(self, interval: float, step) -> None:
    while True:
      try:
        await step()
      except asyncio.CancelledError:
        raise
      except Exception as e:
        discovery_log.log(VERBOSE, "Tailscale discovery: %s failed: %r", step.__name__, e)
      await asyncio.sleep(interval)

  async def publish(self) -> None:
    for name, value in published_attributes(self.node_id, self.node_port, self.device_capabilities).items():
      await self.api.set_device_attribute(self.device_id, name, value)

  async def discover_once(self) -> None:
    devices = await self.api.list_devices(self.tailnet)
    recent = [d for d in devices if seconds_since(d.get("lastSeen", "")) <= self.discovery_timeout and d.get("name") != self.node_id]
    await asyncio.gather(*[self._consider(device) for device in recent])

  async def _consider(self, device: dict) -> None:
    device_id = device.get("nodeId") or device.get("id")
    if not device_id or device_id == self.device_id or not device.get("addresses"):
      return
    found = read_attributes(await self.api.get_device_attributes(device_id))
    if found is None:
      return
    peer_id, port, caps = found
    if peer_id == self.node_id or (self.allowed_node_ids and peer_id not in self.allowed_node_ids):
      return
    address = f"{device['addresses'][0]}:{port}"
    known = self.known_peers.get(peer_id)
    handle = known[0] if known is not None and known[0].addr() == address else self.create_peer_handle(peer_id, address, DESCRIPTION, caps)
    if not await handle.health_check():
      discovery_log.debug("Tailscale peer %s at %s failed its health check", peer_id, address)
      return
    now = time.time()
    if known is None or known[0] is not handle:
      log.log(VERBOSE, "Adding Tailscale peer %s at %s", peer_id, address)
      self.known_peers[peer_id] = (handle, now, now)
    else:
      self.known_peers[peer_id] = (handle, known[1], now)

  async def cleanup_once(self) -> None:
    now = time.time()
    peers = list(self.known_peers.items())
    healthy = await asyncio.gather(*[handle.health_check() for _, (handle, _, _) in peers])
    for (peer_id, (handle, _, last_seen)), ok in zip(peers, healthy):
      if (not ok or now - last_seen > self.discovery_timeout) and self.known_peers.get(peer_id, (None,))[0] is handle:
        discovery_log.log(VERBOSE, "Removing Tailscale peer %s: healthy=%s, last seen %.0f s ago", peer_id, ok, now - last_seen)
        del self.known_peers[peer_id]
    discovery_log.debug("Peer statuses: %s", {p: f"health_check={ok}" for (p, _), ok in zip(peers, healthy)})

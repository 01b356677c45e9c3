"""Peers from a JSON file listing every node: for fixed clusters, and for tests on one host (the ring protocol:
docs/architecture.md).

The file is re-read when its mtime increases, so nodes can be added or moved without restarts; a broken edit
keeps the last good peer set. Every listed peer is health-checked each round; a healthy one becomes a peer, and a
peer leaves the set after failing FAILED_ROUNDS rounds in a row (one missed check on a busy host, a few seconds of
a node loading a model, would otherwise end every request that crosses it)."""
import asyncio
import logging
import os
from typing import Callable, Dict, List, Optional

from exo.logs import DISCOVERY, VERBOSE
from exo.networking.discovery import Discovery
from exo.networking.manual.network_topology_config import NetworkTopology, PeerConfig
from exo.networking.peer_handle import PeerHandle
from exo.topology.device_capabilities import DeviceCapabilities

log = logging.getLogger(__name__)
discovery_log = logging.getLogger(DISCOVERY)

DESCRIPTION = "MAN"
FAILED_ROUNDS = 2


class NodeNotInConfigError(ValueError):
  """This node's own id is not a key of the config's peers (logged; the last good peer set is kept)."""


class ManualDiscovery(Discovery):
  def __init__(self, network_config_path: str, node_id: str,
               create_peer_handle: Callable[[str, str, str, DeviceCapabilities], PeerHandle], poll_interval: float = 5.0):
    self.network_config_path = network_config_path
    self.node_id = node_id
    self.create_peer_handle = create_peer_handle
    self.poll_interval = poll_interval
    self.known_peers: Dict[str, PeerHandle] = {}  # healthy: the peer set
    self._handles: Dict[str, PeerHandle] = {}  # one handle per listed peer, reused between rounds
    self._failed: Dict[str, int] = {}  # peers' failed rounds in a row
    self._peers_config: Dict[str, PeerConfig] = {}
    self._config_mtime: Optional[float] = None
    self._task: Optional[asyncio.Task] = None
    # A missing or invalid file fails startup with a clear message; later bad edits only keep the old set.
    self._load_config(raise_errors=True)

  def _load_config(self, raise_errors: bool = False) -> None:
    try:
      mtime = os.path.getmtime(self.network_config_path)
    except OSError:
      mtime = None
    if mtime is not None and self._config_mtime is not None and mtime <= self._config_mtime:
      return
    self._config_mtime = mtime  # a broken file is reported once, not every round
    try:
      config = NetworkTopology.from_path(self.network_config_path)
    except (FileNotFoundError, ValueError) as e:
      if raise_errors:
        raise
      log.warning("Manual discovery: %s; keeping peers %s", e, sorted(self._peers_config))
      return
    if self.node_id not in config.peers:
      error = NodeNotInConfigError(f"Node ID {self.node_id} not found in config file {self.network_config_path}. "
                                   f"Please run with `--node-id` set to one of the keys in the config file: {sorted(config.peers)}")
      log.warning("Manual discovery: %s; keeping peers %s", error, sorted(self._peers_config))
      return
    self._peers_config = {peer_id: peer for peer_id, peer in config.peers.items() if peer_id != self.node_id}
    discovery_log.debug("Loaded %s: peers %s", self.network_config_path, sorted(self._peers_config))

  def _handle_for(self, peer_id: str, peer: PeerConfig) -> PeerHandle:
    address = f"{peer.address}:{peer.port}"
    handle = self._handles.get(peer_id)
    if handle is None or handle.addr() != address:
      handle = self.create_peer_handle(peer_id, address, DESCRIPTION, peer.device_capabilities)
      self._handles[peer_id] = handle
    return handle

  async def poll_once(self) -> None:
    self._load_config()
    configured = dict(self._peers_config)
    for peer_id in [p for p in self._handles if p not in configured]:
      await self._handles.pop(peer_id).disconnect()
    handles = {peer_id: self._handle_for(peer_id, peer) for peer_id, peer in configured.items()}
    healthy = await asyncio.gather(*[h.health_check() for h in handles.values()])
    statuses = dict(zip(handles, healthy))
    self._failed = {peer_id: 0 if statuses[peer_id] else self._failed.get(peer_id, 0) + 1 for peer_id in handles}
    next_peers = {peer_id: handle for peer_id, handle in handles.items()
                  if statuses[peer_id] or (peer_id in self.known_peers and self._failed[peer_id] < FAILED_ROUNDS)}
    for peer_id in [p for p in self.known_peers if p not in next_peers]:
      # Gone unhealthy: the node disconnects the handle it was given; probe with a fresh one from now on.
      self._handles.pop(peer_id, None)
    if set(next_peers) != set(self.known_peers):
      log.log(VERBOSE, "Manual discovery peers: %s (were %s)", sorted(next_peers), sorted(self.known_peers))
    self.known_peers = next_peers
    if discovery_log.isEnabledFor(logging.DEBUG):
      connected = {p: await h.is_connected() for p, h in handles.items()}
      discovery_log.debug("Peer statuses: %s", {p: f"is_connected={connected[p]}, health_check={statuses[p]}" for p in handles})

  async def _poll(self) -> None:
    while True:
      await asyncio.sleep(self.poll_interval)
      try:
        await self.poll_once()
      except Exception as e:
        discovery_log.log(VERBOSE, "Manual discovery round failed: %r", e)

  async def start(self) -> None:
    await self.poll_once()  # peers known right away, not one interval later
    self._task = asyncio.create_task(self._poll())

  async def stop(self) -> None:
    if self._task is not None:
      self._task.cancel()
      await asyncio.gather(self._task, return_exceptions=True)
      self._task = None
    for peer_id, handle in list(self._handles.items()):
      if peer_id not in self.known_peers:  # handles given to the node are the node's to close
        await handle.disconnect()

  async def discover_peers(self, wait_for_peers: int = 0) -> List[PeerHandle]:
    while len(self.known_peers) < wait_for_peers:
      await asyncio.sleep(0.1)
    return list(self.known_peers.values())

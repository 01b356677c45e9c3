"""A node's place in the ring: its peers, the topology, the partition of layers, sending to the others and the inbox
of what they send (nothing here knows of requests)."""
import asyncio
import ipaddress
import logging
from typing import Callable, Dict, List, Optional, Set, Tuple

from exo.helpers import AsyncCallbackSystem
from exo.inference.shard import Shard
from exo.logs import VERBOSE
from exo.orchestration import statuses
from exo.topology.device_capabilities import UNKNOWN_DEVICE_CAPABILITIES, DeviceCapabilities
from exo.topology.partitioning_strategy import Partition, PartitioningStrategy, map_partitions_to_shards
from exo.topology.topology import Topology

log = logging.getLogger(__name__)

PEER_CALL_TIMEOUT_S = 15.0

# (request id, the checked status, the sender's address or None for this node) -> False to drop it
Handler = Callable[[str, statuses.Status, Optional[str]], Optional[bool]]


class Inbox:
  """The statuses the others send, each parsed and checked once (statuses.parse), then handed to its kind's handlers.
  Peer handlers act on what other nodes say (never on this node's own statuses) and may drop a status by returning
  False; observers see every status of their kind, this node's own included."""

  def __init__(self) -> None:
    self._peer: Dict[str, List[Handler]] = {}
    self._observers: Dict[str, List[Handler]] = {}

  def on_peer(self, kind: str, handler: Handler) -> None:
    self._peer.setdefault(kind, []).append(handler)

  def observe(self, kind: str, handler: Handler) -> None:
    self._observers.setdefault(kind, []).append(handler)

  def from_peer(self, request_id: str, raw: str, sender_host: Optional[str]) -> bool:
    """A status a peer sent. False if it was invalid or dropped."""
    parsed = self._parse(raw, sender_host)
    if parsed is None:
      return False
    kind, status = parsed
    for handler in self._peer.get(kind, ()):
      if handler(request_id, status, sender_host) is False:
        return False
    self._notify(kind, request_id, status, sender_host)
    return True

  def from_self(self, request_id: str, raw: str, quiet: bool = False) -> None:
    """A status this node sent (or one handed to the built-in observer): observers only."""
    parsed = self._parse(raw, None, quiet)
    if parsed is not None:
      self._notify(parsed[0], request_id, parsed[1], None)

  def _notify(self, kind: str, request_id: str, status: statuses.Status, sender_host: Optional[str]) -> None:
    for handler in self._observers.get(kind, ()):
      handler(request_id, status, sender_host)

  @staticmethod
  def _parse(raw: str, sender_host: Optional[str], quiet: bool = False) -> Optional[Tuple[Optional[str], statuses.Status]]:
    try:
      return statuses.parse(raw)
    except statuses.InvalidStatus as e:
      if not quiet:
        log.warning("exo: dropped an invalid status from %s: %s", sender_host or "a peer", e)
      return None


class RingMember:
  def __init__(self, _id: str, discovery, partitioning_strategy: Optional[PartitioningStrategy], topology_viz=None):
    self.id = _id
    self.discovery = discovery
    self.partitioning_strategy = partitioning_strategy
    self.topology_viz = topology_viz
    self.peers: List = []
    self.topology = Topology()
    self.device_capabilities: DeviceCapabilities = UNKNOWN_DEVICE_CAPABILITIES
    self.peer_hosts: Dict[str, Set[str]] = {}  # peer id -> the IP addresses it is reached at (its calls come from there)
    self.peer_engines: Dict[str, List[str]] = {}  # peer id -> the engines it says it runs
    self.peer_prefix_blocks: Dict[str, int] = {}  # peer id -> the block size it reuses prompt prefixes in, if it does
    self.peer_grammar_engines: Dict[str, str] = {}  # peer id -> the grammar engine it samples requests' grammars with
    self._on_opaque_status = AsyncCallbackSystem[str, Tuple[str, str]]()
    self.inbox = Inbox()
    self._partitions: Tuple[Optional[tuple], List[Partition]] = (None, [])  # (what they were computed from, partitions)
    self._shards: Dict[Tuple[str, int], List[Shard]] = {}  # (model id, layers) -> each partition's shard, for _partitions

  def partitions(self) -> List[Partition]:
    if self.id not in self.topology.nodes:  # before the first topology collection: a ring of one
      self.topology.update_node(self.id, self.device_capabilities)
    # Every message asks several times; the answer changes only with the topology.
    key = (self.partitioning_strategy, self.topology, self.topology.version)
    if self._partitions[0] != key:
      self._partitions = (key, self.partitioning_strategy.partition(self.topology))
      self._shards.clear()
    return self._partitions[1]

  def get_partition_index(self, offset: int = 0) -> Optional[int]:
    if not self.partitioning_strategy:
      return None
    partitions = self.partitions()
    index = next((i for i, p in enumerate(partitions) if p.node_id == self.id), None)
    if index is None:
      raise ValueError(f"No current partition found for node: {self.id}")
    return (index + offset) % len(partitions)

  def get_current_shard(self, base_shard: Shard, index: Optional[int] = None) -> Shard:
    if self.partitioning_strategy is None:  # no ring: this node holds every layer
      return Shard(base_shard.model_id, 0, base_shard.n_layers - 1, base_shard.n_layers)
    if index is None:
      index = self.get_partition_index()
    partitions, model = self.partitions(), (base_shard.model_id, base_shard.n_layers)
    if model not in self._shards:
      self._shards[model] = map_partitions_to_shards(partitions, base_shard.n_layers, base_shard.model_id)
    return self._shards[model][index]

  def is_member_host(self, host: Optional[str]) -> bool:
    """Whether a call from `host` comes from a ring member. Peers are known by address only: the wire has no
    authentication, so anyone who can send from a member's address passes."""
    return host is not None and any(host in hosts for hosts in self.peer_hosts.values())

  def peers_at(self, host: Optional[str]) -> Set[str]:
    return {peer_id for peer_id, hosts in self.peer_hosts.items() if host in hosts}

  async def _update_peers(self, wait_for_peers: int = 0):
    """(changed, added, removed, moved) peers."""
    next_peers = await self.discovery.discover_peers(wait_for_peers)
    current = {p.id(): p for p in self.peers}
    following = {p.id(): p for p in next_peers}
    removed = [p for pid, p in current.items() if pid not in following]
    added = [p for pid, p in following.items() if pid not in current]
    moved = [p for pid, p in following.items() if pid in current and current[pid].addr() != p.addr()]

    async def disconnect(peer):
      try:
        await asyncio.wait_for(peer.disconnect(), 5)
      except Exception as e:
        log.log(VERBOSE, "Failed to disconnect peer %s: %r", peer.id(), e)

    async def connect(peer):
      try:
        if not await peer.is_connected():
          await asyncio.wait_for(peer.connect(), 5)
        return True
      except Exception as e:
        log.log(VERBOSE, "Failed to connect peers: %s@%s: %r", peer.id(), peer.addr(), e)
        return False

    self.peers = list(following.values())  # first: from here on, a call to a peer that left fails as one that left
    await asyncio.gather(*[disconnect(p) for p in removed + [current[p.id()] for p in moved]])
    await asyncio.gather(*[connect(p) for p in next_peers])
    if removed or added or moved or set(self.peer_hosts) != set(following):
      self.peer_hosts = {p.id(): await self._hosts_of(p) for p in self.peers}
      for said in (self.peer_engines, self.peer_prefix_blocks, self.peer_grammar_engines):  # what peers say of themselves
        for pid in set(said) - set(following):
          del said[pid]
    changed = bool(removed or added or moved)
    if changed:
      log.log(VERBOSE, "Peers changed: added %s, removed %s, moved %s", [p.id() for p in added], [p.id() for p in removed], [p.id() for p in moved])
    return changed, added, removed, moved

  @staticmethod
  async def _hosts_of(peer) -> Set[str]:
    host = peer.addr().rsplit(":", 1)[0].strip("[]")
    try:
      return {str(ipaddress.ip_address(host))}
    except ValueError:  # a name (manual discovery): whatever it resolves to
      try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None)
        return {str(ipaddress.ip_address(info[4][0])) for info in infos}
      except OSError:
        return set()

  async def collect_topology(self, visited: Set[str], max_depth: int = 4) -> Topology:
    next_topology = Topology()
    next_topology.update_node(self.id, self.device_capabilities)
    for peer in self.peers:
      next_topology.update_node(peer.id(), peer.device_capabilities())
      next_topology.add_edge(self.id, peer.id(), peer.description())
    prev_visited = set(visited)
    visited = visited | {self.id} | {p.id() for p in self.peers}

    async def collect(peer):
      if peer.id() in prev_visited or max_depth <= 0:
        return
      try:
        other = await asyncio.wait_for(peer.collect_topology(visited, max_depth - 1), 5)
        next_topology.merge(peer.id(), other)
      except Exception as e:
        log.log(VERBOSE, "Error collecting topology from %s: %r", peer.id(), e)

    await asyncio.gather(*[collect(p) for p in self.peers])
    # Partition over exactly self + direct peers, as upstream does.
    direct = {self.id} | {p.id() for p in self.peers}
    next_topology.nodes = {nid: caps for nid, caps in next_topology.nodes.items() if nid in direct}
    next_topology.active_node_id = self.topology.active_node_id
    self.topology = next_topology
    return self.topology

  @property
  def current_topology(self) -> Topology:
    return self.topology

  @property
  def on_opaque_status(self) -> AsyncCallbackSystem[str, Tuple[str, str]]:
    return self._on_opaque_status

  async def broadcast_result(self, request_id: str, result: List[int], is_finished: bool, to: Optional[str] = None,
                             preface: Optional[Dict[str, str]] = None) -> None:
    """SendResult to every peer, or only to `to`; a peer named in `preface` gets that opaque status first."""
    async def send(peer):
      try:
        if preface and peer.id() in preface:
          await asyncio.wait_for(peer.send_opaque_status(request_id, preface[peer.id()]), PEER_CALL_TIMEOUT_S)
        await asyncio.wait_for(peer.send_result(request_id, result, is_finished), PEER_CALL_TIMEOUT_S)
      except Exception as e:
        log.log(VERBOSE, "Error sending result to %s: %r", peer.id(), e)
    await asyncio.gather(*[send(p) for p in self.peers if to is None or p.id() == to])

  async def broadcast_opaque_status(self, request_id: str, status: str, to: Optional[Set[str]] = None) -> None:
    """SendOpaqueStatus to every peer (or only to those in `to`), after this node's own observers."""
    async def send(peer):
      try:
        await asyncio.wait_for(peer.send_opaque_status(request_id, status), PEER_CALL_TIMEOUT_S)
      except Exception as e:
        log.log(VERBOSE, "Error sending opaque status to %s: %r", peer.id(), e)
    # Local observers first: a dead peer must not delay, e.g., a request_error for our own client.
    self.inbox.from_self(request_id, status)
    self._on_opaque_status.trigger_all(request_id, status)
    await asyncio.gather(*[send(p) for p in self.peers if to is None or p.id() in to])

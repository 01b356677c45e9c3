from typing import Dict, Optional, Set

from exo.topology.device_capabilities import DeviceCapabilities


class PeerConnection:
  def __init__(self, from_id: str, to_id: str, description: Optional[str] = None):
    self.from_id, self.to_id, self.description = from_id, to_id, description

  def __repr__(self):
    return f"PeerConnection({self.from_id} -> {self.to_id}, {self.description})"

  def __eq__(self, other):
    return isinstance(other, PeerConnection) and (self.from_id, self.to_id) == (other.from_id, other.to_id)

  def __hash__(self):
    return hash((self.from_id, self.to_id))

  def to_dict(self):
    return {"from_id": self.from_id, "to_id": self.to_id, "description": self.description}


class Topology:
  def __init__(self):
    self.nodes: Dict[str, DeviceCapabilities] = {}
    self.peer_graph: Dict[str, Set[PeerConnection]] = {}
    self.active_node_id: Optional[str] = None
    self.version = 0  # bumped by every change to `nodes`, so partitions computed from them can be reused until then

  def update_node(self, node_id: str, device_capabilities: DeviceCapabilities):
    self.nodes[node_id] = device_capabilities
    self.version += 1

  def get_node(self, node_id: str) -> Optional[DeviceCapabilities]:
    return self.nodes.get(node_id)

  def all_nodes(self):
    return self.nodes.items()

  def add_edge(self, from_id: str, to_id: str, description: Optional[str] = None):
    self.peer_graph.setdefault(from_id, set()).add(PeerConnection(from_id, to_id, description))

  def merge(self, peer_node_id: str, other: "Topology"):
    """Take only what the peer knows first-hand: its own entry and its outgoing edges."""
    if peer_node_id in other.nodes:
      self.update_node(peer_node_id, other.nodes[peer_node_id])
    for conn in other.peer_graph.get(peer_node_id, set()):
      self.add_edge(conn.from_id, conn.to_id, conn.description)

  def __str__(self):
    return f"Topology(Nodes: {self.nodes}, Edges: {self.peer_graph})"

  def to_json(self):
    return {
      "nodes": {node_id: caps.to_dict() for node_id, caps in self.nodes.items()},
      "peer_graph": {node_id: [c.to_dict() for c in conns] for node_id, conns in self.peer_graph.items()},
      "active_node_id": self.active_node_id,
    }

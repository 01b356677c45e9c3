"""This node's part in placement: the members' announced facts (`placement_member`), each model's placement derived
from them (topology/placement.py), which groups have their layers loaded, and loading this node's own layers once placed.

Every node derives the placement itself, versioned by the facts' hash: nothing is elected, and a node that leaves takes
nothing with it. Nodes may briefly disagree: a request carries its origin's route, and a node refuses layers it cannot
run. A peer silent for ANNOUNCE_GRACE_S after joining (an upstream node) turns routing off: one pipeline, as exo's."""
import asyncio
import logging
import time
import uuid
from collections import Counter
from typing import Dict, List, Optional, Tuple

from exo.inference.shard import Shard
from exo.local_checkpoints import model_card
from exo.logs import VERBOSE
from exo.orchestration import statuses
from exo.orchestration.model_gate import gate_key
from exo.topology.model_size import shape_of
from exo.topology.placement import MODES, Group, MemberFacts, Placement, facts_version, place

log = logging.getLogger(__name__)

ANNOUNCE_GRACE_S = 10.0  # a peer that has not announced this long after it joined is taken for an upstream node
SUSPECT_S = 30.0  # a peer that failed a health check takes no new requests for this long, unless it answers again
PLACEMENTS_KEPT = 64
EARLY_FACTS_KEPT = 64  # facts from nodes not found yet, kept until they are (a bound against a flood of made-up ids)


class Placements:
  def __init__(self, node):
    self.node = node
    self.mode: Optional[str] = None  # None: this node does not follow routes (a plain Node, as upstream's)
    self.grace_s = ANNOUNCE_GRACE_S
    self.float_bytes = 4
    self.speed = 0.0
    self.peer_facts: Dict[str, MemberFacts] = {}
    self.peer_loaded: Dict[str, Optional[Shard]] = {}
    self.joined_at: Dict[str, float] = {}
    self.suspects: Dict[str, float] = {}
    self._early: Dict[str, Tuple[dict, str]] = {}  # node id -> (facts, sender host) heard before this node knew the peer
    self._placements: Dict[Tuple[str, int, str], Placement] = {}
    self._announced: Optional[str] = None
    self._preloading: Optional[asyncio.Task] = None
    self.expected: Optional[Shard] = None  # the model to load before any request asks for it (the API's default model)
    node.inbox.observe(statuses.PLACEMENT_MEMBER, self._heard)

  def enable(self, mode: str, float_bytes: int, speed: float) -> None:
    if mode not in MODES:
      raise ValueError(f"placement must be one of {', '.join(MODES)}, got {mode!r}")
    self.mode, self.float_bytes, self.speed = mode, float_bytes, speed

  def own_facts(self) -> MemberFacts:
    node = self.node
    return MemberFacts(node.id, node.inference_engine.__class__.__name__, self.float_bytes, node.device_capabilities.memory, self.speed, self.mode)

  def members(self) -> List[MemberFacts]:
    """This node and the peers that announced, are connected and have not failed a health check lately."""
    now = time.monotonic()
    peers = [p.id() for p in self.node.peers]
    return [self.own_facts()] + [self.peer_facts[p] for p in peers if p in self.peer_facts and now - self.suspects.get(p, -SUSPECT_S) >= SUSPECT_S]

  def undeclared(self) -> List[str]:
    """Peers connected for longer than the grace that never announced: upstream nodes."""
    now = time.monotonic()
    return [p.id() for p in self.node.peers if p.id() not in self.peer_facts and now - self.joined_at.get(p.id(), now) >= self.grace_s]

  def heard_all_peers(self) -> bool:
    """Every connected peer has announced its facts or been taken for an upstream node (the placement counts them all)."""
    undeclared = set(self.undeclared())
    return self.mode is None or all(p.id() in self.peer_facts or p.id() in undeclared for p in self.node.peers)

  @property
  def active(self) -> bool:
    """Whether requests are routed: this node follows routes and every peer does."""
    return self.mode is not None and not self.undeclared()

  def placement(self, base: Shard) -> Optional[Placement]:
    if not self.active:
      return None
    members = self.members()
    # Keyed by the facts themselves, not their version: hashing them took ~30 us, twice a step (ring_ids).
    key = (base.model_id, base.n_layers, tuple(sorted(f.key() for f in members)))
    if key not in self._placements:
      if len(self._placements) >= PLACEMENTS_KEPT:
        self._placements.clear()
      self._placements[key] = place(base.model_id, base.n_layers, members, shape_of(base.model_id))
      log.log(VERBOSE, "Placement of %s (version %s): %s", base.model_id, facts_version(members), [g.name for g in self._placements[key].groups])
    return self._placements[key]

  def own_shard(self, base: Shard) -> Optional[Shard]:
    placement = self.placement(base)
    return None if placement is None else placement.shard_of(self.node.id)

  def loaded(self, node_id: str) -> Optional[Shard]:
    return self.node.model_pool.announced() if node_id == self.node.id else self.peer_loaded.get(node_id)

  def ready(self, group: Group, base: Shard) -> bool:
    """Every node of the group holds its layers now."""
    return all(self.loaded(s.node_id) == Shard(base.model_id, s.start, s.end, base.n_layers) for s in group.stages)

  def available(self, group: Group) -> bool:
    members = {f.node_id for f in self.members()}
    return all(n in members for n in group.node_ids)

  def can_serve(self, shard: Shard) -> bool:
    """Whether this node runs these layers for a route: it holds them, it is placed to, or it can load them without
    disturbing a request (nodes that have not heard the same facts yet plan other cuts for a moment)."""
    node = self.node
    node.model_pool.expect(shard)  # (its size and model, for whether it fits beside the models held here)
    return node.model_pool.holds(shard) or self.own_shard(shard) == shard or node.model_gate.no_request_disturbed_by(gate_key(shard))

  async def announce(self) -> None:
    if self.mode is None:
      return
    loaded = self.loaded(self.node.id)
    facts = self.own_facts()
    status = statuses.PlacementMember.build(node_id=self.node.id, engine=facts.engine, float_bytes=facts.float_bytes, memory_mb=facts.memory_mb,
                                            speed=facts.speed, placement=facts.mode, loaded=loaded)
    self._announced = repr(loaded)
    await self.node.broadcast_opaque_status("", status)

  def _heard(self, request_id: str, status: statuses.PlacementMember, sender_host: Optional[str]) -> None:
    node_id = status.node_id
    if sender_host is None or node_id == self.node.id:
      return
    if node_id not in self.node.peer_hosts:  # a newcomer announces when it finds us, maybe before we find it
      if len(self._early) >= EARLY_FACTS_KEPT:
        self._early.clear()
      self._early[node_id] = (status, sender_host)
      return
    if sender_host not in self.node.peer_hosts[node_id]:
      return  # only a peer speaks for itself
    self.peer_facts[node_id] = MemberFacts(node_id, status.engine, int(status.float_bytes), int(status.memory_mb), status.speed, status.placement)
    self.peer_loaded[node_id] = status.loaded
    if status.loaded and self.loaded(self.node.id) is None:
      self.settle()  # a node that joins loads its layers of the model the others serve

  def peers_changed(self, added: List, removed: List) -> None:
    now = time.monotonic()
    for peer in added:
      self.joined_at[peer.id()] = now
      if peer.id() in self._early:  # checked now that the peer's address is known
        self._heard("", *self._early.pop(peer.id()))
    for peer in removed:
      for table in (self.joined_at, self.peer_facts, self.peer_loaded, self.suspects):
        table.pop(peer.id(), None)
    if added and self.mode is not None:
      self.node.spawn(self.announce())  # the newcomers hear of this node at once

  def settle(self) -> None:
    """Load this node's layers of the model in use (its engine's, else the one most peers hold, else the expected one)
    once placed, unless that would disturb a request; not before every peer has announced (a placement without them
    could be a whole copy of a model this node cannot hold)."""
    if not self.active or any(p.id() not in self.peer_facts for p in self.node.peers):
      return
    loaded = self.loaded(self.node.id)
    model = loaded or self._most_loaded() or self.expected
    if model is not None and (self._preloading is None or self._preloading.done()):
      own = self.own_shard(model)
      if own is not None and own != loaded:
        self._preloading = self.node.spawn(self.preload(model))
        if model is self.expected:
          self.expected = None  # tried once (a model still to download waits for a request instead)
    if repr(loaded) != self._announced:
      self.node.spawn(self.announce())

  def _most_loaded(self) -> Optional[Shard]:
    counts = Counter((s.model_id, s.n_layers) for s in self.peer_loaded.values() if s is not None)
    if not counts:
      return None
    (model_id, n_layers), _ = min(counts.items(), key=lambda item: (-item[1], item[0]))
    return Shard(model_id, 0, 0, n_layers)

  def to_json(self, bases: Optional[List[Shard]] = None) -> dict:
    """The placement as /v1/topology and the TUI show it: the members, and the groups of each model of `bases` (the
    one loaded here by default) with their layers."""
    if self.mode is None:
      return {"mode": "off", "active": False}
    if bases is None:
      loaded = self.loaded(self.node.id)
      bases = [loaded] if loaded is not None else []
    members = self.members()
    view = {"mode": self.mode, "active": self.active, "version": facts_version(members), "undeclared": self.undeclared(),
            "members": {f.node_id: {"memory_mb": f.memory_mb, "speed": f.speed, "engine": f.engine, "placement": f.mode,
                                    "loaded": (self.loaded(f.node_id).to_dict() if self.loaded(f.node_id) else None)} for f in members},
            "models": {}}
    for base in bases:
      placement = self.placement(base)
      if placement is not None:
        view["models"][base.model_id] = {**placement.to_json(), "ready": [self.ready(g, base) for g in placement.groups]}
    return view

  async def preload(self, shard: Shard) -> None:
    """Load our own layers of a model unless that would disturb the requests this node serves. The download leaves
    the model gate open (it may take minutes); the load holds it."""
    node = self.node
    try:
      card = model_card(shard.model_id)
      own = node.own_shard(shard)
    except ValueError:  # a local checkpoint this node does not serve, or no layers here
      return
    if card is None or card["layers"] != shard.n_layers or not node.model_gate.idle_for(gate_key(own)):
      return
    holder = f"preload-{uuid.uuid4()}"
    try:
      await node.shard_downloader.ensure_shard(own, node.inference_engine.__class__.__name__)
      node.model_pool.expect(own)
      if not node.model_gate.hold_if_idle(holder, gate_key(own)):
        return
      await node.model_pool.engine_of(own).ensure_shard(own)
    except Exception as e:
      log.log(VERBOSE, "Preloading %s failed: %r", shard.model_id, e)
    finally:
      node.model_gate.leave(holder)
    if self.mode is not None and node.model_pool.holds(own):
      await self.announce()  # the routers of the others may send it requests now

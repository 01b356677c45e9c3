"""Placement: which nodes hold which layers of a model, as groups that each serve a whole copy of it.

A group is the fewest nodes whose memory holds one copy (weights at each node's precision plus a KV reserve), and
there are as many groups as the nodes allow: a replica per node when the model fits one node, pipelines of two or
more nodes when it does not, and mixes where memory gives that. Inside a group the layers are cut so that every
stage takes the same time: each layer costs its weights and the work between its products, the output head its
weights (every row's logits are one product with it), divided by the node's measured speed. Nodes left over that
cannot hold a copy together join the group whose slowest stage is slowest, if they can hold a layer.

A pure function of the members' facts (`MemberFacts`: what each node announced) and the model's shape, so every node
that has heard the same facts derives the same placement; `facts_version` names a set of facts, and travels with
every route so that a node can tell whether the route was planned from what it knows itself."""
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from exo.inference.shard import Shard
from exo.topology.model_size import KEEPS_WINDOW, ModelShape, kv_value_bytes, shape_of, weight_bytes

MODES = ("auto", "pipeline", "replicas")
MIB = 2**20
# A layer's step costs more than its products: attention over the cache, norms, rope, the MLP's activation and a dozen
# small calls, where the head is one large product. Timed with the numpy engine on SmolLM2 at 1 to 32 rows a step,
# the head (8 layers' weights) took as long as 5.2 to 6.2 layers: a layer counts its weights half again.
LAYER_WORK = 1.5


@dataclass(frozen=True)
class MemberFacts:
  """What a node that follows routes announces about itself."""
  node_id: str
  engine: str  # the engine's class name (the weights' precision depends on it)
  float_bytes: int  # the float width its engine computes and keeps KV in
  memory_mb: int  # the memory it offers the cluster
  speed: float  # its measured arithmetic speed (GFLOP/s), for cutting layers
  mode: str  # the placement it is set to (auto, pipeline, replicas)

  def key(self) -> tuple:
    return (self.node_id, self.engine, self.float_bytes, self.memory_mb, round(self.speed, 3), self.mode)


@dataclass(frozen=True)
class Stage:
  node_id: str
  start: int  # first layer, inclusive
  end: int  # last layer, inclusive


@dataclass(frozen=True)
class Group:
  stages: Tuple[Stage, ...]  # first layers first

  @property
  def node_ids(self) -> Tuple[str, ...]:
    return tuple(s.node_id for s in self.stages)

  @property
  def name(self) -> str:
    return "+".join(self.node_ids)

  def stage_of(self, node_id: str) -> Optional[Stage]:
    return next((s for s in self.stages if s.node_id == node_id), None)


@dataclass(frozen=True)
class Placement:
  model_id: str
  n_layers: int
  version: str  # the facts it was derived from (facts_version)
  mode: str  # the mode in effect
  groups: Tuple[Group, ...]

  def group_of(self, node_id: str) -> Optional[Group]:
    return next((g for g in self.groups if node_id in g.node_ids), None)

  def shard_of(self, node_id: str) -> Optional[Shard]:
    group = self.group_of(node_id)
    stage = group.stage_of(node_id) if group else None
    return None if stage is None else Shard(self.model_id, stage.start, stage.end, self.n_layers)

  def to_json(self) -> dict:
    return {"model": self.model_id, "n_layers": self.n_layers, "version": self.version, "mode": self.mode,
            "groups": [{"name": g.name, "stages": [{"node_id": s.node_id, "start_layer": s.start, "end_layer": s.end} for s in g.stages]}
                       for g in self.groups]}


def facts_version(facts: Sequence[MemberFacts]) -> str:
  """A short name for a set of facts: equal on every node that holds the same facts."""
  text = json.dumps(sorted(f.key() for f in facts))
  return hashlib.blake2b(text.encode(), digest_size=5).hexdigest()


def effective_mode(facts: Sequence[MemberFacts]) -> str:
  """The members' mode when they agree; one pipeline over every node (exo's own placement) when they do not."""
  modes = {f.mode for f in facts}
  return modes.pop() if len(modes) == 1 else "pipeline"


class _Costs:
  """Bytes and time of a stage of layers [start, end] on a node."""

  def __init__(self, model_id: str, n_layers: int, shape: Optional[ModelShape]):
    self.model_id, self.n_layers, self.shape = model_id, n_layers, shape

  def work(self, start: int, end: int) -> float:
    """Weights every row multiplies through, each layer's counted LAYER_WORK times, and the head's on the last stage."""
    if self.shape is None:
      return float(end - start + 1)
    head = self.shape.head_weights if end == self.n_layers - 1 else 0
    return (end - start + 1) * self.shape.layer_weights * LAYER_WORK + head

  def time(self, facts: MemberFacts, start: int, end: int) -> float:
    return self.work(start, end) / max(facts.speed, 1e-9)

  def bytes(self, facts: MemberFacts, start: int, end: int) -> float:
    shape = self.shape
    if shape is None:
      return 0.0
    weights = (end - start + 1) * shape.layer_weights
    if start == 0:
      weights += shape.embedding_weights
    if end == self.n_layers - 1 and not (shape.tied and start == 0):
      weights += shape.head_weights
    kv = shape.kv_reserve(start, end, facts.engine in KEEPS_WINDOW) * kv_value_bytes(facts.engine, facts.float_bytes)
    return weights * weight_bytes(facts.engine, facts.float_bytes, self.model_id) + kv

  def capacity(self, facts: MemberFacts) -> float:
    """The share of a whole copy this node's memory holds."""
    whole = self.bytes(facts, 0, self.n_layers - 1)
    return math.inf if whole <= 0 else facts.memory_mb * MIB / whole


def stage_bytes(facts: MemberFacts, shard: Shard) -> float:
  """Bytes a node of `facts` holds for a shard: its weights and its KV reserve, as placement counts them (0 when the
  model's shape is unknown)."""
  return _Costs(shard.model_id, shard.n_layers, shape_of(shard.model_id)).bytes(facts, shard.start_layer, shard.end_layer)


def place(model_id: str, n_layers: int, facts: Sequence[MemberFacts], shape: Optional[ModelShape]) -> Placement:
  """The placement of a model over the members (see the module's docstring)."""
  facts = sorted(facts, key=lambda f: f.node_id)
  mode, costs = effective_mode(facts), _Costs(model_id, n_layers, shape)
  if shape is None:
    mode = "pipeline"  # its size is unknown: every node takes a share, as exo always placed models
  if not facts:
    groups: List[Group] = []
  elif mode == "replicas":
    groups = [Group((Stage(f.node_id, 0, n_layers - 1),)) for f in facts]
  elif mode == "pipeline":
    groups = [_split(ring_order(facts), costs)]
  else:
    groups = _auto_groups(facts, costs)
  return Placement(model_id, n_layers, facts_version(facts), mode, tuple(groups))


def ring_order(facts: Sequence[MemberFacts]) -> List[MemberFacts]:
  """A pipeline's order: memory descending, ties by id descending (the order exo's memory-weighted ring uses)."""
  return sorted(facts, key=lambda f: (f.memory_mb, f.node_id), reverse=True)


def _auto_groups(facts: List[MemberFacts], costs: _Costs) -> List[Group]:
  capacity = {f.node_id: costs.capacity(f) for f in facts}
  members: List[List[MemberFacts]] = [[f] for f in facts if capacity[f.node_id] >= 1]
  rest = sorted((f for f in facts if capacity[f.node_id] < 1), key=lambda f: (-capacity[f.node_id], f.node_id))
  while rest and sum(capacity[f.node_id] for f in rest) >= 1:
    group = [rest.pop(0)]  # the largest first: the fewest nodes
    while sum(capacity[f.node_id] for f in group) < 1:
      missing = 1 - sum(capacity[f.node_id] for f in group)
      enough = [f for f in rest if capacity[f.node_id] >= missing]
      pick = min(enough, key=lambda f: (capacity[f.node_id], f.node_id)) if enough else rest[0]  # the smallest that completes it
      rest.remove(pick)
      group.append(pick)
    members.append(group)
  if not members:  # no copy fits anywhere: every node takes a share and hopes
    return [_split(ring_order(facts), costs)]
  groups = [_split(ring_order(m), costs) for m in members]
  for leftover in sorted(rest, key=lambda f: f.node_id):
    slowest = max(range(len(groups)), key=lambda i: (_slowest_stage(groups[i], members[i], costs), -i))
    joined = _split(ring_order(members[slowest] + [leftover]), costs, require_memory=True)
    if joined is not None and _slowest_stage(joined, members[slowest] + [leftover], costs) < _slowest_stage(groups[slowest], members[slowest], costs):
      members[slowest].append(leftover)
      groups[slowest] = joined
  return groups


def _slowest_stage(group: Group, members: Sequence[MemberFacts], costs: _Costs) -> float:
  facts = {f.node_id: f for f in members}
  return max(costs.time(facts[s.node_id], s.start, s.end) for s in group.stages)


def _split(order: Sequence[MemberFacts], costs: _Costs, require_memory: bool = False) -> Optional[Group]:
  """Contiguous layers for each node in `order` (at least one each), the slowest stage as fast as possible, each
  within its node's memory where that is possible (else regardless, unless `require_memory`)."""
  order = list(order)[:costs.n_layers]
  for within_memory in (True, False):
    cut = _best_cut(order, costs, within_memory)
    if cut is not None:
      return Group(tuple(Stage(f.node_id, start, end) for f, (start, end) in zip(order, cut)))
    if require_memory:
      return None
  raise AssertionError("a cut without memory limits always exists")


def _best_cut(order: List[MemberFacts], costs: _Costs, within_memory: bool) -> Optional[List[Tuple[int, int]]]:
  """Dynamic programme over (nodes placed, layers placed): the least possible slowest stage."""
  n, k = costs.n_layers, len(order)
  best: Dict[Tuple[int, int], Tuple[float, int]] = {(0, 0): (0.0, 0)}  # (nodes, layers) -> (slowest stage, layers of the last node)
  for j, facts in enumerate(order):
    memory = facts.memory_mb * MIB
    for done in range(j, n - (k - j) + 1):
      if (j, done) not in best:
        continue
      for end in range(done, n - (k - j - 1)):
        if within_memory and costs.bytes(facts, done, end) > memory:
          break
        slowest = max(best[(j, done)][0], costs.time(facts, done, end))
        if (j + 1, end + 1) not in best or slowest < best[(j + 1, end + 1)][0]:
          best[(j + 1, end + 1)] = (slowest, end + 1 - done)
  if (k, n) not in best:
    return None
  cut, layers = [], n
  for j in range(k, 0, -1):
    size = best[(j, layers)][1]
    cut.append((layers - size, layers - 1))
    layers -= size
  return cut[::-1]

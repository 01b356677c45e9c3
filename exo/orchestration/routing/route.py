"""A request's route: the nodes that run it, first layers first, each with its layers, the placement version it was
planned under and its origin (the node whose client waits for its tokens).

A routed request carries its route in its inference state (`"route"`, JSON); every node on it runs the layers the
route gives it, not those of its own view of the topology. A ring route (`travels` False) is the one every node
derives from its own topology when no route came with a request, as exo always did; it never goes on the wire."""
import functools
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from exo.inference.shard import Shard
from exo.topology.placement import Stage

MAX_HOPS = 64
MAX_ID_CHARS = 256


class InvalidRoute(ValueError):
  """A route that cannot be followed; str(self) says why."""


@dataclass(frozen=True)
class Route:
  hops: Tuple[Stage, ...]
  version: str = ""  # the placement's version; "" for a ring route
  origin: Optional[str] = None

  @property
  def travels(self) -> bool:
    """Whether it goes with the request (planned by its origin) rather than derived by each node."""
    return bool(self.version)

  @property
  def node_ids(self) -> Tuple[str, ...]:
    return tuple(hop.node_id for hop in self.hops)

  @property
  def group(self) -> str:
    return "+".join(self.node_ids)

  @property
  def first(self) -> Stage:
    return self.hops[0]

  def stage_of(self, node_id: str) -> Optional[Stage]:
    return next((hop for hop in self.hops if hop.node_id == node_id), None)

  def after(self, node_id: str) -> Stage:
    """The hop after `node_id`'s: from the last layers back to the first (the next token)."""
    ids = self.node_ids
    return self.hops[(ids.index(node_id) + 1) % len(ids)]

  def shard(self, stage: Stage, base: Shard) -> Shard:
    return Shard(base.model_id, stage.start, stage.end, base.n_layers)

  def shard_of(self, node_id: str, base: Shard) -> Optional[Shard]:
    stage = self.stage_of(node_id)
    return None if stage is None else self.shard(stage, base)

  @functools.cached_property
  def json(self) -> dict:
    """As it travels in the inference state (made once: every message of the request carries it; never changed)."""
    return {"v": self.version, "origin": self.origin, "hops": [[h.node_id, h.start, h.end] for h in self.hops]}

  @classmethod
  def of(cls, data: Any, n_layers: int) -> "Route":
    """A route from an inference state (a peer's JSON, checked: hops in order that cover every layer once), or the
    Route itself when it is one already (a hop inside this process, or checked by the gRPC server)."""
    if isinstance(data, Route):
      return data
    if not isinstance(data, dict):
      raise InvalidRoute("route must be an object")
    version, origin, hops = data.get("v"), data.get("origin"), data.get("hops")
    if not isinstance(version, str) or not version or len(version) > MAX_ID_CHARS:
      raise InvalidRoute("route.v must be a non-empty string")
    if not isinstance(origin, str) or not origin or len(origin) > MAX_ID_CHARS:
      raise InvalidRoute("route.origin must be a node id")
    if not isinstance(hops, list) or not 1 <= len(hops) <= MAX_HOPS:
      raise InvalidRoute(f"route.hops must list 1 to {MAX_HOPS} hops")
    stages, expected = [], 0
    for hop in hops:
      if (not isinstance(hop, list) or len(hop) != 3 or not isinstance(hop[0], str) or not hop[0] or len(hop[0]) > MAX_ID_CHARS
          or not all(isinstance(v, int) and not isinstance(v, bool) for v in hop[1:])):
        raise InvalidRoute("each route hop must be [node id, first layer, last layer]")
      if hop[1] != expected or hop[2] < hop[1]:
        raise InvalidRoute(f"route hops must cover the layers in order from 0; hop {hop!r} does not start at {expected}")
      stages.append(Stage(hop[0], hop[1], hop[2]))
      expected = hop[2] + 1
    if expected != n_layers:
      raise InvalidRoute(f"route covers {expected} layers, the model has {n_layers}")
    if len({s.node_id for s in stages}) != len(stages):
      raise InvalidRoute("a node appears twice on the route")
    return cls(tuple(stages), version, origin)

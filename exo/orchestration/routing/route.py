"""A request's route: the nodes that run it, first layers first, each with its layers, the placement version it was
planned under and its origin (the node whose client waits for its tokens). A routed request carries it in its
inference state (`"route"`); a ring route (`travels` False) is the one each node derives from its own topology when
none came, as exo always did, and never goes on the wire."""
import functools
from dataclasses import dataclass
from typing import Annotated, Any, List, Optional, Tuple

from pydantic import BaseModel, Field, StrictInt, ValidationError

from exo.inference.shard import Shard
from exo.orchestration.statuses import MAX_ID_CHARS, Id
from exo.topology.placement import Stage

MAX_HOPS = 64


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

  def after(self, node_id: str) -> Stage:
    """The hop after `node_id`'s: from the last layers back to the first (the next token)."""
    ids = self.node_ids
    return self.hops[(ids.index(node_id) + 1) % len(ids)]

  def shard(self, stage: Stage, base: Shard) -> Shard:
    return Shard(base.model_id, stage.start, stage.end, base.n_layers)

  def shard_of(self, node_id: str, base: Shard) -> Optional[Shard]:
    stage = next((hop for hop in self.hops if hop.node_id == node_id), None)
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
    try:
      wire = _Wire.model_validate(data)
    except ValidationError as e:
      first = e.errors(include_url=False)[0]
      raise InvalidRoute(f"route.{'.'.join(map(str, first['loc']))}: {first['msg']}" if first["loc"] else "route must be an object") from None
    stages = tuple(Stage(*hop) for hop in wire.hops)
    if [s.start for s in stages] != [0] + [s.end + 1 for s in stages[:-1]] or any(s.end < s.start for s in stages) or stages[-1].end != n_layers - 1:
      raise InvalidRoute(f"route hops must cover the {n_layers} layers in order from 0, each once: {wire.hops!r}"[:MAX_ID_CHARS])
    if len({s.node_id for s in stages}) != len(stages):
      raise InvalidRoute("a node appears twice on the route")
    return cls(stages, wire.v, wire.origin)


class _Wire(BaseModel):
  """A route as it travels: the placement version, the origin, and [node id, first layer, last layer] per hop."""
  v: Id
  origin: Id
  hops: Annotated[List[Tuple[Id, StrictInt, StrictInt]], Field(min_length=1, max_length=MAX_HOPS)]

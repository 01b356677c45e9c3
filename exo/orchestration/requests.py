"""What a node knows of each request: one record per request id, with a status that only moves forward.

A record is opened when the node first hears of a request and closed once. Closed ids are remembered a while, so a late
message for an ended request is dropped instead of starting it again; records that never got work here (parameters
for a request that never came) expire after QUEUED_KEPT_S."""
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np

from exo.inference.sampling import SamplingParams, TokenLogprobs, make_generator
from exo.inference.shard import Shard

if TYPE_CHECKING:  # (importing them here would be slow or circular)
  import asyncio

  from exo.inference.grammar import Constraint
  from exo.inference.inference_engine import InferenceEngine
  from exo.inference.penalties import TokenCounts
  from exo.orchestration.routing.route import Route

QUEUED_KEPT_S = 300.0  # a record with no work here (parameters only) is forgotten after this long
QUEUED_KEPT = 4096  # and at most this many such records are kept: the oldest go first
ENDED_KEPT_S = 600.0  # ended ids are remembered this long ...
ENDED_KEPT = 10000  # ... and at most this many


class RequestEnded(Exception):
  """The request ended while this work was waiting or running for it: drop the work, quietly."""


@dataclass
class RequestEvent:
  """What a request's local client hears: new tokens (the last with finished=True) and their logprobs, or an error."""
  tokens: List[int]
  finished: bool
  error: Optional[str] = None
  logprobs: Optional[List[Optional[TokenLogprobs]]] = None


class Status(Enum):
  QUEUED = "queued"  # known here (its parameters, or waiting for this node's model), no work done yet
  PREFILLING = "prefilling"  # its prompt is being computed here
  DECODING = "decoding"  # its prompt is done here; it comes back for each new token
  FINISHED = "finished"
  FAILED = "failed"
  CANCELLED = "cancelled"

  @property
  def ended(self) -> bool:
    return self in (Status.FINISHED, Status.FAILED, Status.CANCELLED)


_ORDER = {status: i for i, status in enumerate(Status)}


@dataclass
class Sampling:
  """What the node that samples a request (the one with its model's last layers) keeps of it."""
  generator: np.random.Generator  # its random stream
  tokens: List[int] = field(default_factory=list)  # tokens sampled for it here
  eos_ids: Optional[Set[int]] = None  # its model's end tokens
  constraint: Optional["Constraint"] = None  # its grammar's matcher (exo/inference/grammar.py)
  penalty_counts: Optional["TokenCounts"] = None  # what its penalties count (exo/inference/penalties.py)
  logprobs: Optional[TokenLogprobs] = None  # the logprobs of the token just sampled, until the step core sends it


@dataclass
class Delivery:
  """What the node its tokens are delivered to (its origin, whose client asked) keeps of a request."""
  received: int = 0  # tokens a peer has sent here
  logprobs_ahead: Dict[int, TokenLogprobs] = field(default_factory=dict)  # token position -> logprobs sent ahead of it


@dataclass
class FirstStage:
  """What the node with a request's first layers keeps of its prompt."""
  prompt_tokens: int  # its prompt's length
  rerun: Optional[Tuple[Shard, np.ndarray]] = None  # (shard, prompt ids) while a reused prefix may need undoing
  sequence: Optional[List[int]] = None  # in a ring that reuses prefixes: the ids its KV cache holds here


@dataclass(eq=False)
class Request:
  """What every node on its path knows of a request; a role's own state only where the role is."""
  id: str
  params: SamplingParams
  origin: Optional[str] = None  # the node whose client asked (None for requests from upstream nodes)
  status: Status = Status.QUEUED
  model: Optional[str] = None  # the model it runs on here, once it has work here
  engine: Optional["InferenceEngine"] = None  # the engine its model runs on here (the node's model pool), once the gate let it in
  admitted: Optional["asyncio.Future[None]"] = None  # its turn at the model gate here, once it has asked
  route: Optional["Route"] = None  # the Route it follows here (routing/route.py), once it has work here or was routed here
  told_next: bool = False  # this node has sent it on along its route once (its parameters went with it)
  positions: int = 0  # positions of it this node's layers have computed (its KV cache length here)
  sampling: Optional[Sampling] = None  # on the node that samples it, from its first step there (sampled_here)
  delivery: Optional[Delivery] = None  # where its tokens are delivered, from the first (delivered_here)
  first_stage: Optional[FirstStage] = None  # on the node with its first layers, once its prompt is tokenised there
  created: float = field(default_factory=time.monotonic)

  @property
  def ring(self) -> Tuple[str, ...]:
    """The ids of the nodes of its route: the nodes it needs."""
    return () if self.route is None else self.route.node_ids

  @property
  def group(self) -> Optional[str]:
    """The placement group its route is (travelling routes only)."""
    return self.route.group if self.route is not None and self.route.travels else None

  def sampled_here(self) -> Sampling:
    self.sampling = self.sampling or Sampling(make_generator(self.params.seed))
    return self.sampling

  def delivered_here(self) -> Delivery:
    self.delivery = self.delivery or Delivery()
    return self.delivery

  def advance(self, status: Status) -> None:
    """Move forward to `status`; never back, and never out of an end."""
    if not self.status.ended and _ORDER[status] > _ORDER[self.status]:
      self.status = status


class RequestRegistry:
  def __init__(self) -> None:
    self._live: Dict[str, Request] = {}
    self._ended: "OrderedDict[str, Tuple[float, Status]]" = OrderedDict()  # id -> (when, how), oldest first
    self._opened: "OrderedDict[str, None]" = OrderedDict()  # ids in the order they were opened (some since started or ended)

  def __len__(self) -> int:
    return len(self._live)

  def __iter__(self) -> Iterator[Request]:
    return iter(list(self._live.values()))

  def get(self, request_id: str) -> Optional[Request]:
    """The live record, or None (never seen, or ended)."""
    return self._live.get(request_id)

  def is_live(self, request_id: str) -> bool:
    return request_id in self._live

  def ended(self, request_id: str) -> Optional[Status]:
    """How the request ended, if it ended here recently."""
    entry = self._ended.get(request_id)
    return None if entry is None else entry[1]

  def open(self, request_id: str, params: Optional[SamplingParams] = None, origin: Optional[str] = None) -> Optional[Request]:
    """The live record for `request_id`, opened if new; None if the request has already ended here."""
    if request_id in self._ended:
      return None
    request = self._live.get(request_id)
    if request is None:
      self._make_room()
      request = self._live[request_id] = Request(request_id, params or SamplingParams(), origin)
      self._opened[request_id] = None
    return request

  def end(self, request_id: str, status: Status) -> Optional[Request]:
    """Close the request (also if never seen here, so that late messages are dropped); its record if it was live."""
    assert status.ended
    request = self._live.pop(request_id, None)
    if request is not None:
      request.advance(status)
    if request_id not in self._ended:
      self._ended[request_id] = (time.monotonic(), status)
      while len(self._ended) > ENDED_KEPT:
        self._ended.popitem(last=False)
    return request

  def sweep(self, now: Optional[float] = None) -> List[Request]:
    """Forget old ended ids; return the queued records that expired (the caller ends them)."""
    now = time.monotonic() if now is None else now
    while self._ended and now - next(iter(self._ended.values()))[0] > ENDED_KEPT_S:
      self._ended.popitem(last=False)
    self._opened = OrderedDict((i, None) for i in self._opened if self._queued(i))
    return [self._live[i] for i in self._opened if now - self._live[i].created > QUEUED_KEPT_S]

  def _queued(self, request_id: str) -> bool:
    request = self._live.get(request_id)
    return request is not None and request.status is Status.QUEUED

  def _make_room(self) -> None:
    """At most QUEUED_KEPT records without work: a flood of parameters pushes out the oldest, never a started request."""
    while len(self._opened) >= QUEUED_KEPT:
      request_id, _ = self._opened.popitem(last=False)
      if self._queued(request_id):
        del self._live[request_id]
        return

"""Which models this node's engines serve, and when another may be loaded.

A request holds the gate for its model from its first work here until it ends; `room` says whether a model may be let
in beside those held (ModelPool: while memory and its limit allow; without a room, only when none is). Requests wait in
line in arrival order, whatever their model, so busy models cannot starve another; one that waits longer than `wait_s`
ends with ModelBusy. A preload holds the gate like a request while it loads."""
import asyncio
from collections import deque
from typing import TYPE_CHECKING, Deque, Dict, List, Optional, Set, Tuple

if TYPE_CHECKING:
  from exo.orchestration.model_pool import ModelPool

DEFAULT_WAIT_S = 300.0


def gate_key(shard) -> str:
  """What the gate admits requests by: the model, and the layers when they are not all of it (other layers of a model
  wait as another model would)."""
  whole = shard.start_layer == 0 and shard.end_layer == shard.n_layers - 1
  return shard.model_id if whole else f"{shard.model_id} (layers {shard.start_layer}-{shard.end_layer})"


class ModelBusy(RuntimeError):
  """The node served other models for longer than the request could wait."""


class LeftTheLine(Exception):
  """The request ended while it waited."""


class ModelGate:
  def __init__(self, wait_s: float = DEFAULT_WAIT_S, room: Optional["ModelPool"] = None):
    self.wait_s = wait_s
    self.room = room  # None: one model at a time
    self.serving: Optional[str] = None  # the model let in last
    self.model_of: Dict[str, str] = {}  # holder (a request id, or a preload's) -> its model
    self.preloads: Set[str] = set()  # the holders that are preloads, not requests
    self._line: Deque[Tuple[str, str, asyncio.Future]] = deque()  # (model, request id, admitted)

  def held(self, besides_preloads: bool = False) -> Set[str]:
    """The models requests (and preloads, unless `besides_preloads`) hold now."""
    return {m for h, m in self.model_of.items() if not (besides_preloads and h in self.preloads)}

  def in_line(self) -> List[str]:
    """The requests waiting for their turn, first first."""
    return [request_id for _, request_id, admitted in self._line if not admitted.done()]

  def _has_room(self, model: str, held: Set[str]) -> bool:
    return model in held or (self.room.fits(model, held) if self.room is not None else not held)

  def idle_for(self, model: str) -> bool:
    """Nothing would be disturbed by loading `model` now."""
    return not self._line and self._has_room(model, self.held())

  def no_request_disturbed_by(self, model: str) -> bool:
    """Whether a request for `model` would wait at most behind a preload and requests for `model` itself."""
    return all(m == model for m, _, _ in self._line) and self._has_room(model, self.held(besides_preloads=True))

  def hold_if_idle(self, holder: str, model: str) -> bool:
    """Hold the gate for `model` now if that disturbs nobody (a preload: it never waits in line). False if not."""
    if not self.idle_for(model):
      return False
    self._admit(holder, model)
    self.preloads.add(holder)
    return True

  async def enter(self, request_id: str, model: str) -> None:
    if request_id in self.model_of:
      return
    if self.idle_for(model):
      self._admit(request_id, model)
      return
    admitted = asyncio.get_running_loop().create_future()
    self._line.append((model, request_id, admitted))
    try:
      await asyncio.wait_for(asyncio.shield(admitted), self.wait_s)
    except asyncio.TimeoutError:
      serving = ", ".join(sorted(self.held())) or self.serving
      raise ModelBusy(f"this node is serving {serving} to {len(self.model_of)} request(s); the request for {model} "
                      f"waited {self.wait_s:.0f} s for them to end") from None
    finally:
      if not admitted.done():  # timed out or cancelled: out of the line
        admitted.cancel()
        self._let_in()

  def leave(self, request_id: str) -> None:
    """The request has ended here: it lets go of the model, or leaves the line."""
    self.preloads.discard(request_id)
    model = self.model_of.pop(request_id, None)
    if model is not None and model not in self.model_of.values() and self.room is not None:
      self.room.release(model)
    for _, waiting, admitted in self._line:
      if waiting == request_id and not admitted.done():
        admitted.set_exception(LeftTheLine(request_id))
    self._let_in()

  def _admit(self, request_id: str, model: str) -> None:
    if model not in self.model_of.values() and self.room is not None:
      self.room.admit(model)
    self.serving = model
    self.model_of[request_id] = model

  def _let_in(self) -> None:
    while self._line:
      model, request_id, admitted = self._line[0]
      if admitted.done():  # it gave up
        self._line.popleft()
        continue
      if not self._has_room(model, self.held()):
        return
      self._line.popleft()
      self._admit(request_id, model)
      admitted.set_result(None)

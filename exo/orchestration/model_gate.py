"""Which model this node's engine serves, and when it may switch to another.

The engine holds one model at a time. A request holds the gate for its model from its first work at this node until
it ends; the engine switches models only when no request holds the gate, so one user's request for another model
never wipes the KV caches of the requests in flight. Requests wait in line, in arrival order: the first one that
needs another model waits until the requests of the loaded one have ended, and those that arrive after it wait
behind it, whatever their model, so a busy model cannot starve the other. A request that waits longer than
`wait_s` ends with ModelBusy. A preload holds the gate like a request while it loads, so no request for another
model is let in meanwhile (the load would replace that request's model under it)."""
import asyncio
from collections import deque
from typing import Deque, List, Optional, Set, Tuple

DEFAULT_WAIT_S = 300.0


def gate_key(shard) -> str:
  """What the gate admits requests by: the model, and the layers when they are not all of it (a node that is to hold
  other layers of the same model must wait for the requests on the ones it holds, as for another model)."""
  whole = shard.start_layer == 0 and shard.end_layer == shard.n_layers - 1
  return shard.model_id if whole else f"{shard.model_id} (layers {shard.start_layer}-{shard.end_layer})"


class ModelBusy(RuntimeError):
  """The node served another model for longer than the request could wait."""


class LeftTheLine(Exception):
  """The request ended while it waited."""


class ModelGate:
  def __init__(self, wait_s: float = DEFAULT_WAIT_S):
    self.wait_s = wait_s
    self.serving: Optional[str] = None  # the model the holders use
    self.holders: Set[str] = set()  # request ids
    self.preloads: Set[str] = set()  # the holders that are preloads, not requests
    self._line: Deque[Tuple[str, str, asyncio.Future]] = deque()  # (model, request id, admitted)

  def holds(self, request_id: str) -> bool:
    return request_id in self.holders

  def in_line(self) -> List[str]:
    """The requests waiting for their turn, first first."""
    return [request_id for _, request_id, admitted in self._line if not admitted.done()]

  def idle_for(self, model: str) -> bool:
    """Nothing would be disturbed by loading `model` now."""
    return not self._line and (not self.holders or self.serving == model)

  def no_request_disturbed_by(self, model: str) -> bool:
    """Whether a request for `model` would wait at most behind a preload and requests for `model` itself."""
    return all(m == model for m, _, _ in self._line) and (self.serving == model or self.holders <= self.preloads)

  def hold_if_idle(self, holder: str, model: str) -> bool:
    """Hold the gate for `model` now if that disturbs nobody (a preload: it never waits in line). False if not."""
    if not self.idle_for(model):
      return False
    self._admit(holder, model)
    self.preloads.add(holder)
    return True

  async def enter(self, request_id: str, model: str) -> None:
    if request_id in self.holders:
      return
    if self.idle_for(model):
      self._admit(request_id, model)
      return
    admitted = asyncio.get_running_loop().create_future()
    self._line.append((model, request_id, admitted))
    try:
      await asyncio.wait_for(asyncio.shield(admitted), self.wait_s)
    except asyncio.TimeoutError:
      raise ModelBusy(f"this node is serving {self.serving} to {len(self.holders)} request(s); the request for {model} "
                      f"waited {self.wait_s:.0f} s for them to end") from None
    finally:
      if not admitted.done():  # timed out or cancelled: out of the line
        admitted.cancel()
        self._let_in()

  def leave(self, request_id: str) -> None:
    """The request has ended here: it lets go of the model, or leaves the line."""
    self.holders.discard(request_id)
    self.preloads.discard(request_id)
    for _, waiting, admitted in self._line:
      if waiting == request_id and not admitted.done():
        admitted.set_exception(LeftTheLine(request_id))
    self._let_in()

  def _admit(self, request_id: str, model: str) -> None:
    self.serving = model
    self.holders.add(request_id)

  def _let_in(self) -> None:
    while self._line:
      model, request_id, admitted = self._line[0]
      if admitted.done():  # it gave up
        self._line.popleft()
        continue
      if self.holders and self.serving != model:
        return
      self._line.popleft()
      self._admit(request_id, model)
      admitted.set_result(None)

"""Run-ahead (EXO_RUN_AHEAD=0 turns it off): on a node that holds every layer of a model, a decoding row's next step
is known as soon as its token is sampled (its input is that token, and it comes back here). The step core starts that
step on the engine's thread at once (`start`), and the loop's next step takes its result (`call`) instead of calling
the engine, so the event loop's per-token work (the hook, the output, the stream) runs while the engine steps. It is
the step the loop would have run: the same rows and inputs on the same engine, started only when nothing else waits.

Greedy rows may be chained further on the engine's thread (inference/chained_steps.py): the loop registers a chained
step as soon as it takes the result of the one before, so that no row runs twice, and a row that arrives from
elsewhere revokes the grants (`revoke`), so that the next step takes it in. A row that finishes instead never takes
its result: it goes with its request (`forget`), whose KV cache is freed as at any end."""
import asyncio
from dataclasses import dataclass
from typing import Awaitable, Callable, Dict, FrozenSet, List, Optional, Tuple

import numpy as np

from exo.inference.chained_steps import Ticket
from exo.inference.shard import Shard

Item = Tuple[str, np.ndarray, Optional[dict]]  # request id, input, state: a row of an engine step


@dataclass
class Started:
  """One row of a step started ahead: its input, and the step's results (a list, the row's at `index`)."""
  shard: Shard
  tensor: np.ndarray
  index: int
  results: asyncio.Future
  ticket: Ticket

  async def result(self, shard: Shard, tensor: np.ndarray, state: Optional[dict]):
    """The row's (output, state), or its error; the state is the one the loop's step gives it."""
    if self.shard != shard or not np.array_equal(self.tensor, tensor):
      return RuntimeError("a step ran ahead with another input than the one this step gives the request")  # (a bug: never expected)
    try:
      result = (await self.results)[self.index]
    except Exception as e:  # the whole step failed, as a step the loop called would have
      return e
    return result if isinstance(result, BaseException) else (result[0], state)


class RunAhead:
  def __init__(self, enabled: bool, is_live: Callable[[str], bool] = lambda request_id: True):
    self.enabled, self.is_live = enabled, is_live
    self.rows: Dict[str, Started] = {}  # request id -> its row of a step started ahead, until a step of the loop takes it
    self.taken: Dict[str, Ticket] = {}  # request id -> the ticket of its started step that a step of the loop awaits
    self.steps_chained = 0  # steps the engine's thread chained
    self.rows_taken = 0  # rows whose step of the loop took a result run ahead

  def start(self, engine, shard: Shard, rows: List[Tuple[str, np.ndarray]], follow: Optional[Dict[str, FrozenSet[int]]] = None) -> bool:
    """The step of `rows` (request id, input) started on the engine now (the loop has checked that it can: see
    StepLoop.can_run_ahead), unless the engine has chained it already; `follow` (request id -> the tokens that end
    it): the greedy rows whose next step may then follow on the engine's thread."""
    tickets = {self.rows[request_id].ticket for request_id, _ in rows if request_id in self.rows}
    if not tickets:
      ticket = Ticket()
      if follow:  # before the step starts: a short step could end before a grant given after
        ticket.grant(follow)
      results = engine.start_ahead(shard, [(request_id, tensor, None) for request_id, tensor in rows], ticket)
      if results is None:
        return False
      self._register(shard, rows, results, ticket)
      return True
    if len(tickets) > 1 or any(request_id not in self.rows for request_id, _ in rows):
      return False  # (rows of two steps, or not all chained: they go one step at a time)
    if follow:
      next(iter(tickets)).grant(follow)
    return True

  def _register(self, shard: Shard, rows: List[Tuple[str, np.ndarray]], results: asyncio.Future, ticket: Ticket) -> None:
    results.add_done_callback(_retrieved)
    for index, (request_id, tensor) in enumerate(rows):
      self.rows[request_id] = Started(shard, tensor, index, results, ticket)

  def revoke(self) -> None:
    """No step follows the ones started (awaited by the loop's step or not yet): another row waits for the next step."""
    for ticket in {started.ticket for started in self.rows.values()} | set(self.taken.values()):
      ticket.revoke()

  def forget(self, request_id: str) -> None:
    started = self.rows.pop(request_id, None)
    ticket = started.ticket if started is not None else self.taken.get(request_id)
    if ticket is not None:
      ticket.revoke(request_id)

  def clear(self) -> None:
    self.revoke()
    self.rows.clear()
    self.taken.clear()

  def call(self, engine, shard: Shard, items: List[Item]) -> Awaitable[list]:
    """The results of a step's items: a row started ahead takes its started step's, the others one engine call (queued
    on the engine's thread after the started step)."""
    started = {request_id: self.rows.pop(request_id) for request_id, _, _ in items if request_id in self.rows}
    if not started:
      return engine.infer_batch(shard, items)
    self.taken.update((request_id, s.ticket) for request_id, s in started.items())
    rest = [item for item in items if item[0] not in started]
    return self._joined(shard, items, started, engine.infer_batch(shard, rest) if rest else None)

  async def _joined(self, shard: Shard, items: List[Item], started: Dict[str, Started], fresh: Optional[Awaitable[list]]) -> list:
    try:
      fresh_results = iter(list(await fresh) if fresh is not None else [])
      self.rows_taken += len(started)
      results = [await started[request_id].result(shard, tensor, state) if request_id in started else next(fresh_results, None)
                 for request_id, tensor, state in items]
    finally:
      for request_id in started:
        self.taken.pop(request_id, None)
    for ticket in {s.ticket for s in started.values()}:  # the step the engine chained to it runs already: its rows must take it
      chained = ticket.chained
      if chained is not None:
        rows = [(request_id, tensor) for request_id, tensor, _ in chained.rows]
        self._register(shard, rows, asyncio.wrap_future(chained.results), chained.ticket)
        for request_id, _ in rows:
          if not self.is_live(request_id):  # it ended meanwhile: it never comes back
            self.forget(request_id)
        self.steps_chained += 1
    return results


def _retrieved(results: asyncio.Future) -> None:
  """A step whose rows all finished meanwhile is never awaited: its error, if any, is nobody's to report."""
  if not results.cancelled():
    results.exception()

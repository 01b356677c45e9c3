"""Run-ahead: on a node that holds every layer of a model, a decoding row's next step is known as soon as its token is
sampled (its input is that token, and it comes back to this node). The step core starts that step on the engine's
thread at once (`start`), before the token goes through the hook, the step's output, its stream and its client; the
loop's next step then takes its result (`call`) instead of calling the engine. The per-token work of the event loop
so runs while the engine steps, as vLLM's asynchronous scheduling overlaps its CPU work with the model's.

A step run ahead is the step the loop would have run: the same rows with the same inputs on the same engine, and only
when nothing else waits for a step here. A row that finishes instead (its end of sequence or token limit, a stop
string, a cancel) never takes its result: it goes with its request (`forget`), whose KV cache is freed as at any end,
the extra position with it; the engine never begins a cache for it. EXO_RUN_AHEAD=0 turns it off."""
import asyncio
from dataclasses import dataclass
from typing import Awaitable, Dict, List, Optional, Tuple

import numpy as np

from exo.inference.shard import Shard

Item = Tuple[str, np.ndarray, Optional[dict]]  # request id, input, state: a row of an engine step


@dataclass
class Started:
  """One row of a step started ahead: its input, and the step's results (a list, the row's at `index`)."""
  shard: Shard
  tensor: np.ndarray
  index: int
  results: asyncio.Future

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
  def __init__(self, enabled: bool):
    self.enabled = enabled
    self.rows: Dict[str, Started] = {}  # request id -> its row of a step started ahead, until a step of the loop takes it
    self.steps_started = 0
    self.rows_taken = 0  # rows whose step of the loop took a result run ahead

  def start(self, engine, shard: Shard, rows: List[Tuple[str, np.ndarray]]) -> bool:
    """The step of `rows` (request id, input) started on the engine now, where the engine can (`start_ahead`)."""
    start = getattr(engine, "start_ahead", None)
    if not self.enabled or start is None or not rows or any(request_id in self.rows for request_id, _ in rows):
      return False
    results = start(shard, [(request_id, tensor, None) for request_id, tensor in rows])
    if results is None:
      return False
    results.add_done_callback(_retrieved)
    for index, (request_id, tensor) in enumerate(rows):
      self.rows[request_id] = Started(shard, tensor, index, results)
    self.steps_started += 1
    return True

  def forget(self, request_id: str) -> None:
    self.rows.pop(request_id, None)

  def clear(self) -> None:
    self.rows.clear()

  def call(self, engine, shard: Shard, items: List[Item]) -> Awaitable[list]:
    """The results of a step's items: a row started ahead takes its started step's, the others one engine call (queued
    on the engine's thread after the started step)."""
    started = {request_id: self.rows.pop(request_id) for request_id, _, _ in items if request_id in self.rows}
    if not started:
      return engine.infer_batch(shard, items)
    rest = [item for item in items if item[0] not in started]
    return self._joined(shard, items, started, engine.infer_batch(shard, rest) if rest else None)

  async def _joined(self, shard: Shard, items: List[Item], started: Dict[str, Started], fresh: Optional[Awaitable[list]]) -> list:
    fresh_results = iter(list(await fresh) if fresh is not None else [])
    self.rows_taken += len(started)
    return [await started[request_id].result(shard, tensor, state) if request_id in started else next(fresh_results, None)
            for request_id, tensor, state in items]


def _retrieved(results: asyncio.Future) -> None:
  """A step whose rows all finished meanwhile is never awaited: its error, if any, is nobody's to report."""
  if not results.cancelled():
    results.exception()

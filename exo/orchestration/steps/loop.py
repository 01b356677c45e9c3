"""The step loop: one per node, through which every forward pass goes. It asks each shard's Scheduler for the next
step, runs it on the engine of that shard's model (one step at a time; the shard that stepped least recently first),
and hands the results back to the Scheduler and the waiting callers (`run`).

A request that ends leaves at once (`forget`). `finishing_for(scheduler, step)`, asked before the engine call, may
return what finishes the step's rows (on a Node, the step core); that returns what sends their output, run once the
waiters have heard None, before the next step. A message's `accepted` future (the gRPC reply waits for it) is resolved
just before the step that runs its rows."""
import asyncio
import logging
import time
from typing import Awaitable, Callable, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np

from exo import settings
from exo.inference.shard import Shard
from exo.orchestration.steps.ahead import RunAhead
from exo.orchestration.steps.scheduler import Row, Scheduler, Step
from exo.orchestration.requests import RequestEnded

log = logging.getLogger(__name__)

IDLE_LOOK_S = 1.0  # with no work due, the loop looks again at least this often
ARRIVAL_WAIT_S = 0.05  # the most a step waits for requests whose start the engine has queued (see _let_arrivals_in)

Done = List[Tuple[Row, object]]  # rows a step finished, each with its (output, state) or its exception


class BatcherStopped(RuntimeError):
  """The node is stopping: the item was not run."""


class Wake:
  """The loop's wake-up call: `set` ends `sleep` on the next turn of the event loop (an asyncio.Event under wait_for
  takes three turns and a task of its own). A set while the task is awake is not kept: it looks at its work first."""

  def __init__(self) -> None:
    self._sleeper: Optional[asyncio.Future] = None

  def set(self) -> None:
    _settle(self._sleeper, True)

  @property
  def asleep(self) -> bool:
    return self._sleeper is not None

  async def sleep(self, timeout: float) -> bool:
    """Until set (True) or `timeout` seconds have passed (False)."""
    loop = asyncio.get_running_loop()
    sleeper = self._sleeper = loop.create_future()
    timer = loop.call_later(max(timeout, 0.0), _settle, sleeper, False)
    try:
      return await sleeper
    finally:
      timer.cancel()
      self._sleeper = None


def _settle(future: Optional[asyncio.Future], result) -> None:
  if future is not None and not future.done():
    future.set_result(result)


def accept(accepted: Optional[asyncio.Future]) -> None:
  """Resolve a message's acceptance, if it has one that nobody resolved yet."""
  _settle(accepted, None)


class StepLoop:
  def __init__(self, engine, new_scheduler: Callable[[Shard], Scheduler], is_live: Callable[[str], bool] = lambda request_id: True,
               on_step: Callable[[Scheduler, Step], None] = lambda scheduler, step: None,
               finishing_for: Callable[[Scheduler, Step], Optional[Callable[[Done], Awaitable[Callable[[], None]]]]] = lambda scheduler, step: None,
               engine_for: Optional[Callable[[Shard], object]] = None):
    self.engine, self.new_scheduler, self.is_live, self.on_step, self.clock = engine, new_scheduler, is_live, on_step, time.monotonic
    self.finishing_for = finishing_for
    self.engine_for = engine_for or (lambda shard: self.engine)
    self.schedulers: Dict[Shard, Scheduler] = {}
    self._turns: Dict[Shard, int] = {}  # shard -> the number of the step it ran last (which shard's turn it is)
    self._steps_run = 0
    self._waiters: Dict[str, Tuple[asyncio.Future, Optional[asyncio.Future]]] = {}  # request id -> (result, acceptance)
    self._coming: Set[str] = set()  # rows a step sent on to this node itself, until they are in a line again (or end)
    self._wake = Wake()
    self._task: Optional[asyncio.Task] = None
    self._stopped = False
    self._stepped: List[Tuple[Scheduler, Step]] = []  # steps run whose on_step is still to come (see _report_steps)
    self.ahead = RunAhead(settings.env_int("EXO_RUN_AHEAD") != 0, is_live)

  async def infer(self, shard: Shard, request_id: str, tensor: np.ndarray, state: Optional[dict],
                  accepted: Optional[asyncio.Future] = None) -> Optional[Tuple[np.ndarray, Optional[dict]]]:
    """One row (a prompt's pass), a batch of one: its result (None where a finisher took it), or its error raised."""
    [result] = await self.run(shard, [(request_id, tensor, state)], accepted)
    if isinstance(result, BaseException):
      raise result
    return result

  async def run(self, shard: Shard, rows: List[Tuple[str, np.ndarray, Optional[dict]]], accepted: Optional[asyncio.Future] = None,
                whole: bool = False) -> List[object]:
    """A message's rows (request id, input, state), into line together (`whole`: a step of the stage before, due at
    once); each one's result, or its exception, once its step has finished it."""
    if self._stopped:
      raise BatcherStopped("batching has stopped on this node")
    if shard not in self.schedulers:
      self.schedulers[shard] = self.new_scheduler(shard)
    scheduler = self.schedulers[shard]
    futures = [self._line_up(scheduler, *row, accepted, whole) for row in rows]
    if self._task is None:
      self._task = asyncio.get_running_loop().create_task(self._run())
    self._wake.set()
    try:
      return await asyncio.gather(*futures, return_exceptions=True)
    finally:
      for (request_id, _, _), future in zip(rows, futures):
        if self._waiters.get(request_id, (None,))[0] is future:
          del self._waiters[request_id]
          scheduler.drop(request_id)  # its caller has gone
          self._wake.set()

  def _line_up(self, scheduler: Scheduler, request_id: str, tensor: np.ndarray, state: Optional[dict], accepted: Optional[asyncio.Future],
               whole: bool) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    if request_id in self._waiters:  # a second copy of a message (a peer's bug or mischief) must not run on the same cache
      log.warning("exo: dropped a second pass of request %s that arrived while its pass waited or ran here", request_id)
      future.set_result(None)
      return future
    if request_id not in self.ahead.rows:  # the next step takes it in: no step is chained past the ones started
      self.ahead.revoke()
    scheduler.add(request_id, tensor, state, self.clock(), whole)
    self._coming.discard(request_id)
    self._waiters[request_id] = (future, accepted)
    return future

  def expect(self, request_ids: Iterable[str]) -> None:
    """Rows just sent on to this node itself: the next step waits for them (see _let_arrivals_in)."""
    self._coming.update(request_ids)
    self._wake.set()

  @property
  def running(self) -> bool:
    """Whether the loop's task is running (it starts with the first request and ends at stop)."""
    return self._task is not None and not self._task.done()

  def forget(self, request_id: str) -> None:
    """The request has ended on this node: it leaves every line and will not come back."""
    for scheduler in self.schedulers.values():
      scheduler.drop(request_id)
    self._coming.discard(request_id)
    self.ahead.forget(request_id)
    self._fail(request_id, RequestEnded(request_id))
    self._wake.set()

  def can_run_ahead(self, shard: Shard) -> bool:
    """Whether a step of `shard`'s could start ahead now: it would be the step the loop runs next, nothing else
    waiting for a step here (any model's), and the engine can start one."""
    return (self.ahead.enabled and not self._stopped and shard in self.schedulers and not any(s.ready for s in self.schedulers.values())
            and self._prefix_starts_queued() == 0 and hasattr(self.engine_for(shard), "start_ahead"))

  def _fail(self, request_id: str, error: BaseException) -> None:
    future, _ = self._waiters.pop(request_id, (None, None))
    if future is not None and not future.done():
      future.set_exception(error)

  async def _run(self) -> None:
    while not self._stopped:
      try:
        await self._next()
      except Exception as e:  # a bug here must not leave every waiting request hanging: they end with it
        self._fail_all(e)

  async def _next(self) -> None:
    await self._let_arrivals_in()
    now = self.clock()
    # Due now or overdue alike: of those, the shard that stepped least recently goes first.
    for shard, scheduler in sorted(self.schedulers.items(), key=lambda item: (max(item[1].due(now), now), self._turns.get(item[0], -1))):
      step = scheduler.schedule(now)
      if step is not None:
        self._steps_run += 1
        self._turns[shard] = self._steps_run
        await self._step(scheduler, step)
        return
    self._report_steps()
    due = min((s.due(now) for s in self.schedulers.values()), default=float("inf"))
    await self._wake.sleep(IDLE_LOOK_S if due == float("inf") else min(IDLE_LOOK_S, max(due - now, 0.0005)))

  async def _let_arrivals_in(self) -> None:
    """Up to ARRIVAL_WAIT_S for rows on their way here (a new prompt's prefix lookup queued on the engine's thread, the
    rows the last step sent to this node itself), so they join the next step instead of trailing it by one."""
    deadline = time.monotonic() + ARRIVAL_WAIT_S
    while (self._prefix_starts_queued() > 0 or self._coming) and not self._stopped:
      self._report_steps()
      if not await self._wake.sleep(deadline - time.monotonic()):
        self._coming.clear()  # (one that never came, e.g. its prefix was missing here, is not waited for again)
        return

  def _prefix_starts_queued(self) -> int:
    engines = {id(self.engine): self.engine, **{id(e): e for e in map(self.engine_for, self.schedulers)}}
    return sum(getattr(e, "prefix_starts_queued", 0) for e in engines.values())

  async def _step(self, scheduler: Scheduler, step: Step) -> None:
    for row, _ in step.rows:  # a request may have ended while its step was queued
      if not self.is_live(row.request_id) or row.request_id not in self._waiters:
        scheduler.drop(row.request_id)
        self._fail(row.request_id, RequestEnded(row.request_id))
    step.rows = [(row, take) for row, take in step.rows if scheduler.ready.get(row.request_id) is row]
    if not step.rows:
      return
    for row, _ in step.rows:
      accept(self._waiters[row.request_id][1])  # its reply goes out when this task yields: once the engine has the step
    items = step.items()
    finish = self.finishing_for(scheduler, step)
    try:
      engine_call = self.ahead.call(self.engine_for(scheduler.shard), scheduler.shard, items)
      if self._stepped:  # the last steps' on_step runs once this step has the engine, not on the way to it
        asyncio.get_running_loop().call_soon(self._report_steps)
      results = [_checked(r) for r in await engine_call]
      if len(results) != len(items):
        raise RuntimeError(f"engine step of {len(items)} requests returned {len(results)} results")
    except asyncio.CancelledError:  # only when the event loop itself is torn down
      for row, _ in step.rows:
        self._fail(row.request_id, RequestEnded(row.request_id))
      raise
    except Exception as e:  # the whole step failed: each of its requests learns why
      results = [e] * len(items)
    done = scheduler.update(step, results, self.clock())
    send = None
    if finish is not None:
      try:
        send = await finish(done)
      except Exception as e:  # a bug in finishing: the step's rows end with it rather than wait forever
        done = [(row, result if isinstance(result, BaseException) else e) for row, result in done]
    for row, result in done:
      if isinstance(result, BaseException):
        self._fail(row.request_id, result)
      else:
        _settle(self._waiters.pop(row.request_id, (None,))[0], None if send is not None else result)
      if not self.is_live(row.request_id):
        scheduler.drop(row.request_id)
    if send is not None:
      send()  # after the waiters (a hop to this node itself runs the row's next pass, which must find it free)
      await asyncio.sleep(0)  # the sends start before the next step takes the engine
    self._stepped.append((scheduler, step))

  def _report_steps(self) -> None:
    """on_step for the steps run since it last ran: while the next step runs, or before the loop waits."""
    stepped, self._stepped = self._stepped, []
    try:
      for scheduler, step in stepped:
        self.on_step(scheduler, step)
    except Exception as e:  # as a failing step would: its rows' requests end with it rather than wait forever
      self._fail_all(e)

  async def stop(self) -> None:
    """Let the step under way finish (nothing cancels it), then fail the requests still waiting."""
    self._stopped = True
    self._wake.set()
    if self._task is not None:
      await asyncio.gather(self._task, return_exceptions=True)
    self._report_steps()
    self._fail_all(BatcherStopped("node stopping"))

  def _fail_all(self, error: BaseException) -> None:
    """Every request waiting for a step here leaves its line and ends with `error`."""
    for scheduler in self.schedulers.values():
      for request_id in list(scheduler.ready):
        scheduler.drop(request_id)
    self.ahead.clear()
    for request_id in list(self._waiters):
      self._fail(request_id, error)


def _checked(result):
  """An engine's (output, state) pair; anything else fails its own row, not the step."""
  if isinstance(result, BaseException):
    return result
  try:
    output, state = result
  except (TypeError, ValueError) as e:
    return ValueError(f"the engine returned a malformed result: {e}")
  return output, state

"""A task whose coroutine takes its first step at once, in the caller's turn of the event loop, not a turn later as
asyncio.create_task's does (Python 3.12's eager tasks, for the 3.11 this project supports).

The gRPC server starts each message's work so: a hop's rows are in their stage's line when the handler's turn ends,
and the step loop takes them on the next turn."""
import asyncio
from typing import Any, Coroutine, Optional


def start_now(coro: Coroutine) -> asyncio.Task:
  """Run `coro` up to where it first waits, now; a task carries it on from there (and holds its result or error)."""
  try:
    waits_on = coro.send(None)
  except StopIteration as stop:
    return asyncio.ensure_future(_returned(stop.value))
  except BaseException as error:
    return asyncio.ensure_future(_raised(error))
  return asyncio.ensure_future(_carry_on(coro, waits_on))


async def _returned(value: Any) -> Any:
  return value


async def _raised(error: BaseException) -> Any:
  raise error


class _Wait:
  """Awaiting it hands the task the very future the coroutine yielded, as if the task had stepped the coroutine."""

  def __init__(self, future: Optional[asyncio.Future]) -> None:
    self.future = future

  def __await__(self):
    yield self.future


async def _carry_on(coro: Coroutine, waits_on: Optional[asyncio.Future]) -> Any:
  """The rest of `coro` inside this task: each future it yields is waited on here, then it reads the outcome itself
  (a future's await returns its result or raises); an error thrown into this task (a cancel) is thrown into it."""
  while True:
    try:
      await _Wait(waits_on)
      error = None
    except BaseException as e:  # the future's own failure, or this task cancelled
      error = e
    try:
      if error is not None and (waits_on is None or not waits_on.done()):
        waits_on = coro.throw(error)
      else:
        waits_on = coro.send(None)
    except StopIteration as stop:
      return stop.value

"""Waiting for something a test cannot be notified of (another process's state, a server's view): poll it until it
holds. Where an event exists (a future, an asyncio.Event, a callback), tests wait on that instead."""
import asyncio
import inspect
import time
from typing import Callable, Union


async def eventually(condition: Callable, timeout: float = 30.0, what: Union[str, Callable[[], str]] = "", interval: float = 0.05):
  """Call `condition` (a function or a coroutine function) until it returns something truthy, and return that. An
  exception it raises fails the wait at once (a process that died); past `timeout` an AssertionError names `what`
  (a string, or a function giving one when the wait fails, e.g. with the last state seen)."""
  deadline = time.monotonic() + timeout
  while True:
    value = condition()
    if inspect.isawaitable(value):
      value = await value
    if value:
      return value
    if time.monotonic() >= deadline:
      described = what() if callable(what) else what
      raise AssertionError(f"not within {timeout} s: {described or getattr(condition, '__name__', condition)} (last: {value!r})")
    await asyncio.sleep(interval)

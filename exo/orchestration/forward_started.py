"""Knowing when the engine has taken up a message's forward pass.

The gRPC server sets a future in FORWARD_STARTED while it hands a SendTensor / SendPrompt to the node, and replies
once it is resolved. Whatever starts the forward pass resolves it with `announce`: the core just before it calls
the engine, a batching scheduler just before the step that runs the request. A batch's messages then get their
replies while its step runs, not one by one before it (replying costs the server about as much as receiving)."""
import asyncio
from contextvars import ContextVar
from typing import Optional

FORWARD_STARTED: ContextVar[Optional[asyncio.Future]] = ContextVar("exo_forward_started", default=None)


def announce(started: Optional[asyncio.Future]) -> None:
  """Resolve `started` (one taken from FORWARD_STARTED), if there is one and nobody resolved it yet."""
  if started is not None and not started.done():
    started.set_result(None)

"""A streamed reply whose headers go out with its first event: a failure before that still gets its own status code
and error body; a failure after it ends the stream with one last error event (in the dialect's shape)."""
from contextlib import aclosing
from typing import AsyncIterator, Callable, Dict, Iterable, Optional

from aiohttp import web

from exo.api.errors import ApiError
from exo.api.replies import SSE, Framing

# The request's stream, once one has started, so the deadline middleware can end it with an error event.
STREAM_KEY = web.RequestKey("exo_stream", object) if hasattr(web, "RequestKey") else "exo_stream"


class EventStream:
  def __init__(self, request: web.Request, headers: Dict[str, str], error_event: Optional[Callable[[ApiError], object]] = None,
               framing: Framing = SSE):
    self.request = request
    self.framing = framing
    self.response = web.StreamResponse(status=200, headers={"Content-Type": framing.content_type, "Cache-Control": "no-cache", **headers})
    self.error_event = error_event  # the last event's body (or bodies) for an error; None: the stream just ends

  @property
  def started(self) -> bool:
    return self.response.prepared

  async def start(self) -> None:
    if not self.started:
      self.request[STREAM_KEY] = self
      await self.response.prepare(self.request)

  async def send(self, body) -> None:
    await self.start()
    await self.response.write(self.framing.encode(body))

  async def fail(self, error: ApiError) -> None:
    """End a started stream with `error` (the client may be gone already)."""
    if self.error_event is not None:
      bodies = self.error_event(error)
      try:
        for body in bodies if isinstance(bodies, list) else [bodies]:
          await self.response.write(self.framing.encode(body))
      except ConnectionError:
        pass

  async def relay(self, events: AsyncIterator, render: Callable[[object], Iterable], failed: Callable[[Exception], ApiError]) -> web.StreamResponse:
    """Send what `render` makes of each event. A client that leaves ends `events` (and so its generations); a failure
    before the first event is raised, one after it ends the stream with an error event (`failed` turns it into the
    ApiError to send, and counts it)."""
    try:
      async with aclosing(events):
        async for event in events:
          for body in render(event):
            await self.send(body)
      await self.start()
    except ConnectionError:
      return self.response
    except Exception as e:
      if not self.started:
        raise
      await self.fail(failed(e))
    return self.response

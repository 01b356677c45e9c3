"""A server-sent-events reply whose headers go out with its first event: a failure before that still gets its own
status code and JSON error; a failure after it ends the stream with one last error event."""
from typing import Callable, Dict, Optional

from aiohttp import web

from exo.api import responses
from exo.api.errors import ApiError

# The request's stream, once one has started, so the deadline middleware can end it with an error event.
STREAM_KEY = web.RequestKey("exo_stream", object) if hasattr(web, "RequestKey") else "exo_stream"


class EventStream:
  def __init__(self, request: web.Request, headers: Dict[str, str], error_event: Optional[Callable[[ApiError], dict]] = None):
    self.request = request
    self.response = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
    self.error_event = error_event  # the last event's body for an error; None: the stream just ends

  @property
  def started(self) -> bool:
    return self.response.prepared

  async def send(self, body) -> None:
    if not self.started:
      self.request[STREAM_KEY] = self
      await self.response.prepare(self.request)
    await self.response.write(responses.sse(body))

  async def fail(self, error: ApiError) -> None:
    """End a started stream with `error` (the client may be gone already)."""
    if self.error_event is not None:
      try:
        await self.response.write(responses.sse(self.error_event(error)))
      except ConnectionError:
        pass

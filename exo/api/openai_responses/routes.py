"""OpenAI's Responses route: POST /v1/responses, a response object or its events as named SSE. Errors are in
OpenAI's shape, as the API's other OpenAI routes."""
import time
from contextlib import aclosing
from typing import Callable, List, Tuple

from aiohttp import web

from exo.api.errors import ApiError
from exo.api.event_stream import EventStream
from exo.api.events import collect
from exo.api.openai_responses.render import ResponseShape, ResponseStream
from exo.api.openai_responses.request import STATELESS, parse_responses_request
from exo.api.replies import NAMED_SSE, json_reply
from exo.api.serving import ServingCore


class ResponsesRoutes:
  def __init__(self, core: ServingCore):
    self.core = core

  def routes(self) -> List[Tuple[Tuple[str, ...], str, Callable]]:
    return [(("/v1/responses",), "POST", self.handle_responses), (("/v1/responses/{response_id}",), "GET", self.handle_stored)]

  async def handle_stored(self, request: web.Request) -> web.Response:
    raise ApiError(404, f"no response {request.match_info['response_id']!r}: {STATELESS}", param="response_id", code="not_found")

  async def handle_responses(self, request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    core = self.core
    parsed = await core.read(await request.read(), parse_responses_request)
    generation, shape = parsed.generation, ResponseShape(parsed.generation.model, parsed.echo)
    events = core.generate(generation, arrived)
    if generation.stream:
      renderer = ResponseStream(shape)
      return await EventStream(request, {}, renderer.error_events, NAMED_SSE).relay(events, renderer, core.stream_failed)
    async with aclosing(events):
      reply = await collect(events)
    return json_reply(shape.reply(reply.started.request_id, reply.answers[0], reply.usage))

"""Anthropic's Messages routes: POST /v1/messages (a message, or its events as named SSE) and
POST /v1/messages/count_tokens; errors under /v1/messages in Anthropic's shape."""
import time
from contextlib import aclosing
from typing import Callable, List, Tuple

from aiohttp import web

from exo.api.anthropic.render import MessageStream, error_body, message
from exo.api.anthropic.request import parse_count_request, parse_messages_request
from exo.api.errors import ApiError
from exo.api.event_stream import EventStream
from exo.api.events import collect
from exo.api.replies import NAMED_SSE, json_reply
from exo.api.serving import ServingCore


class AnthropicRoutes:
  PREFIXES = ("/v1/messages",)

  def __init__(self, core: ServingCore):
    self.core = core

  def routes(self) -> List[Tuple[Tuple[str, ...], str, Callable]]:
    return [(("/v1/messages",), "POST", self.handle_messages), (("/v1/messages/count_tokens",), "POST", self.handle_count_tokens)]

  @staticmethod
  def error_reply(error: ApiError) -> web.Response:
    return json_reply(error_body(error), error.status, error.headers)

  async def handle_messages(self, request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    core = self.core
    generation = await core.read(await request.read(), parse_messages_request)
    events = core.generate(generation, arrived)
    if generation.stream:
      return await EventStream(request, {}, error_body, NAMED_SSE).relay(events, MessageStream(generation.model), core.stream_failed)
    async with aclosing(events):
      reply = await collect(events)
    return json_reply(message(reply.started.request_id, generation.model, reply.answers[0], reply.usage))

  async def handle_count_tokens(self, request: web.Request) -> web.Response:
    generation = await self.core.read(await request.read(), parse_count_request)
    return json_reply({"input_tokens": await self.core.count_prompt_tokens(generation)})

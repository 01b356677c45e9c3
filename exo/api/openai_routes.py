"""OpenAI's chat and text completions, and upstream's token-encode route: each body read into a GenerationRequest
(exo/api/chat_request.py, exo/api/completion_request.py), served by the core, its events rendered in OpenAI's
shapes (exo/api/openai_shapes.py): one JSON reply, or SSE chunks (each with its choice's index; the chunk that
ends the last choice carries the usage when asked)."""
import time
from contextlib import aclosing
from typing import Callable, List, Tuple

from aiohttp import web

from exo.api.chat_request import EncodeBody, as_dicts, parse_chat_request
from exo.api.completion_request import parse_completion_request
from exo.api.event_stream import EventStream
from exo.api.events import collect
from exo.api.generation_request import GenerationRequest
from exo.api.openai_shapes import ChatShape, ChunkRenderer, TextShape
from exo.api.prompts import build_prompt
from exo.api.replies import json_reply
from exo.api.request_fields import parse_json_body, resolve_model
from exo.api.serving import ServingCore


class OpenAIRoutes:
  def __init__(self, core: ServingCore):
    self.core = core

  def routes(self) -> List[Tuple[Tuple[str, ...], str, Callable]]:
    return [(("/v1/chat/completions", "/chat/completions"), "POST", self.handle_chat_completions),
            (("/v1/completions", "/completions"), "POST", self.handle_completions),
            (("/v1/chat/token/encode", "/chat/token/encode"), "POST", self.handle_token_encode)]

  async def handle_chat_completions(self, request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    generation = await self.core.read(await request.read(), parse_chat_request)
    return await self._reply(request, generation, lambda request_id: ChatShape(request_id, generation.model), arrived)

  async def handle_completions(self, request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    generation = await self.core.read(await request.read(), parse_completion_request)
    return await self._reply(request, generation, lambda request_id: TextShape(request_id, generation.model), arrived)

  async def _reply(self, request: web.Request, generation: GenerationRequest, shape_of, arrived: float) -> web.StreamResponse:
    events = self.core.generate(generation, arrived)
    if generation.stream:
      renderer = ChunkRenderer(shape_of, generation.stream_usage)
      return await EventStream(request, {}, renderer.error_chunk).relay(events, renderer, self.core.stream_failed)
    async with aclosing(events):
      reply = await collect(events)
    return json_reply(shape_of(reply.started.request_id).reply(reply.answers, reply.usage))

  async def handle_token_encode(self, request: web.Request) -> web.Response:
    body = await self.core.in_thread(parse_json_body, await request.read())
    encode = EncodeBody.read(body)
    model = resolve_model(encode.model, self.core.default_model, self.core.engine_classname)
    messages, tools = as_dicts(encode.messages), encode.template_tools(body)
    tokenizer, _ = await self.core.profiles.get(model)

    def encode() -> Tuple[str, list]:
      prompt = build_prompt(tokenizer, messages, tools)
      return prompt, [int(t) for t in tokenizer.encode(prompt)]
    prompt, tokens = await self.core.in_thread(encode)
    return json_reply({"length": len(prompt), "num_tokens": len(tokens), "encoded_tokens": tokens, "encoded_prompt": prompt})

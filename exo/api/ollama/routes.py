"""Ollama's routes: POST /api/chat and /api/generate (NDJSON streams by default), GET /api/tags, /api/ps and
/api/version, POST /api/show, POST /api/embed and the older /api/embeddings; errors under /api/ as Ollama's {"error": "..."}."""
import asyncio
import time
from contextlib import aclosing
from datetime import datetime, timezone
from typing import Callable, List, Tuple

from aiohttp import web

from exo.api.embedding_request import parse_ollama_embed, parse_ollama_embeddings
from exo.api.errors import ApiError
from exo.api.event_stream import EventStream
from exo.api.ollama.models import (config_of, describe, describe_embedding, installed_embedding_models, local_models, model_info,
                                   tagged)
from exo.api.ollama.render import OllamaReply, error_body, now
from exo.api.ollama.request import parse_chat, parse_generate, resolve_ollama_model
from exo.api.reasoning import reasoning_of
from exo.api.replies import NDJSON, json_reply
from exo.api.request_fields import parse_json_body
from exo.api.serving import ServingCore
from exo.keep_alive import wall_times

# The version of Ollama's API these routes follow (clients check it before using newer fields), not exo's own.
OLLAMA_API_VERSION = "0.12.0"
FOREVER = "9999-12-31T23:59:59Z"  # /api/ps's expires_at of a model that stays loaded


def _iso(unix: float) -> str:
  return datetime.fromtimestamp(unix, timezone.utc).isoformat().replace("+00:00", "Z")


def _times(held: dict) -> dict:
  loaded_at, expires_at = wall_times(held)
  return {"expires_at": FOREVER if expires_at is None else _iso(expires_at), "loaded_at": _iso(loaded_at)}


class OllamaRoutes:
  PREFIXES = ("/api/",)

  def __init__(self, core: ServingCore):
    self.core = core

  def routes(self) -> List[Tuple[Tuple[str, ...], str, Callable]]:
    return [(("/api/chat",), "POST", self.handle_chat), (("/api/generate",), "POST", self.handle_generate),
            (("/api/tags",), "GET", self.handle_tags), (("/api/ps",), "GET", self.handle_ps), (("/api/version",), "GET", self.handle_version),
            (("/api/show",), "POST", self.handle_show), (("/api/embed",), "POST", self.handle_embed),
            (("/api/embeddings",), "POST", self.handle_embeddings)]

  @staticmethod
  def error_reply(error: ApiError) -> web.Response:
    return json_reply(error_body(error), error.status, error.headers)

  async def handle_chat(self, request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic_ns()
    return await self._reply(request, await self.core.read(await request.read(), parse_chat), True, arrived)

  async def handle_generate(self, request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic_ns()
    generation = await self.core.read(await request.read(), parse_generate)
    if generation.prompts == [""]:  # Ollama's way to load a model (it loads with the first request here) or, with keep_alive 0, unload it
      if generation.keep_alive is not None:
        self.core.node.model_pool.keep(generation.model, generation.keep_alive, now=True)
      return json_reply({"model": tagged(generation.model), "created_at": now(), "response": "", "done": True, "done_reason": "load"})
    return await self._reply(request, generation, False, arrived)

  async def _reply(self, request: web.Request, generation, chat: bool, arrived_ns: int) -> web.StreamResponse:
    if generation.keep_alive is not None:
      self.core.node.model_pool.keep(generation.model, generation.keep_alive)
    reply = OllamaReply(generation.model, chat, arrived_ns)
    events = self.core.generate(generation, arrived_ns / 1e9)
    if generation.stream:
      return await EventStream(request, {}, error_body, NDJSON).relay(events, reply, self.core.stream_failed)
    usage = None
    async with aclosing(events):
      async for event in events:
        reply.note(event)
        usage = event
    return json_reply(reply.whole(usage))

  async def handle_embed(self, request: web.Request) -> web.Response:
    """{"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}, durations in nanoseconds."""
    started = time.monotonic_ns()
    raw = await request.read()
    embedding = await self.core.in_thread(lambda: parse_ollama_embed(parse_json_body(raw)))
    vectors, tokens = await self.core.embeddings.embed(embedding)
    return await self.core.embeddings.reply(lambda: {"model": tagged(embedding.model), "embeddings": vectors.tolist(),
                                                     "total_duration": time.monotonic_ns() - started, "load_duration": 0, "prompt_eval_count": tokens})

  async def handle_embeddings(self, request: web.Request) -> web.Response:
    """The older route: {"embedding": [...]} for one `prompt`."""
    raw = await request.read()
    embedding = await self.core.in_thread(lambda: parse_ollama_embeddings(parse_json_body(raw)))
    vectors, _ = await self.core.embeddings.embed(embedding)
    return await self.core.embeddings.reply(lambda: {"embedding": vectors[0].tolist()})

  async def handle_tags(self, request: web.Request) -> web.Response:
    engine = self.core.engine_classname
    models = await asyncio.to_thread(lambda: [describe(m, engine) for m in local_models(engine)] +
                                     [describe_embedding(m) for m in installed_embedding_models()])
    return json_reply({"models": models})

  async def handle_ps(self, request: web.Request) -> web.Response:
    """The chat models this node holds (its shards of them) and the embedding models loaded beside them, each until its
    keep-alive runs out (`expires_at`: far in the future while requests use it); `loaded_at`, exo's, when it loaded."""
    models = []
    for held in self.core.node.model_pool.describe():
      entry = await asyncio.to_thread(describe, held["model"], self.core.engine_classname)
      _, limits = await self.core.profiles.get(held["model"])
      models.append({**entry, **_times(held), "size_vram": 0, "context_length": limits.context_length})
    for held in self.core.embeddings.pool.describe():
      entry = await asyncio.to_thread(describe_embedding, held["model"])
      models.append({**entry, **_times(held), "size_vram": 0, "context_length": held["max_tokens"]})
    return json_reply({"models": models})

  async def handle_version(self, request: web.Request) -> web.Response:
    return json_reply({"version": OLLAMA_API_VERSION})

  async def handle_show(self, request: web.Request) -> web.Response:
    body = await self.core.in_thread(parse_json_body, await request.read())
    engine = self.core.engine_classname
    field = "model" if "model" in body else "name"
    model = resolve_ollama_model(body.get(field), self.core.default_model, engine, field)
    if model not in local_models(engine):
      raise ApiError(404, f"model '{body.get('model') or body.get('name')}' not found", code="model_not_found")
    tokenizer, _ = await self.core.profiles.get(model)
    entry, config = await asyncio.to_thread(lambda: (describe(model, engine), config_of(model, engine)))
    return json_reply({"modelfile": f"FROM {model}\n", "parameters": "", "template": getattr(tokenizer, "chat_template", None) or "",
                       "details": entry["details"], "model_info": model_info(config),
                       "capabilities": ["completion", "tools"] + (["thinking"] if reasoning_of(tokenizer) is not None else []),
                       "modified_at": entry["modified_at"]})

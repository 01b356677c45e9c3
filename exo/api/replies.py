"""How replies go on the wire: JSON bodies, and the framings of streamed events (server-sent events with data only,
as OpenAI's chat; with each event's type as its name, as Anthropic's and OpenAI Responses'; newline-delimited JSON,
as Ollama's)."""
import json
from dataclasses import dataclass
from typing import Callable, Optional

from aiohttp import web

from exo.api.errors import ApiError


def json_reply(body: dict, status: int = 200, headers: Optional[dict] = None) -> web.Response:
  """Python json.dumps formatting (", " and ": "), as upstream: aiohttp's json_response does exactly that."""
  return web.json_response(body, status=status, headers=headers)


def sse(body) -> bytes:
  return b"data: " + (body if isinstance(body, str) else json.dumps(body)).encode() + b"\n\n"


def named_sse(body: dict) -> bytes:
  return f"event: {body['type']}\n".encode() + sse(body)


def ndjson(body: dict) -> bytes:
  return json.dumps(body).encode() + b"\n"


@dataclass(frozen=True)
class Framing:
  content_type: str
  encode: Callable[[object], bytes]


SSE = Framing("text/event-stream", sse)
NAMED_SSE = Framing("text/event-stream", named_sse)
NDJSON = Framing("application/x-ndjson", ndjson)


def error_reply(error: ApiError) -> web.Response:
  """OpenAI's error shape (exo/api/errors.py), the API's own; other dialects answer errors in theirs."""
  return json_reply(error.body(), error.status, error.headers)

"""The JSON shapes the API sends, in upstream exo's key order (clients and tests compare them verbatim)."""
import json
import time
from typing import Optional

from aiohttp import web

from exo.api.errors import ApiError
from exo.helpers import VERSION


def json_reply(body: dict, status: int = 200, headers: Optional[dict] = None) -> web.Response:
  """Python json.dumps formatting (", " and ": "), as upstream: aiohttp's json_response does exactly that."""
  return web.json_response(body, status=status, headers=headers)


def error_reply(error: ApiError) -> web.Response:
  return json_reply(error.body(), error.status, error.headers)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _envelope(request_id: str, model: str, choice: dict) -> dict:
  return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()), "model": model,
          "system_fingerprint": f"exo_{VERSION}", "choices": [choice]}


def completion(request_id: str, model: str, content: str, finish_reason: str, usage_: dict) -> dict:
  body = _envelope(request_id, model, {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                                       "finish_reason": finish_reason})
  body["usage"] = usage_
  return body


def chunk(request_id: str, model: str, content: str, finish_reason: Optional[str], usage_: Optional[dict] = None) -> dict:
  """One stream event. Upstream's shape: object "chat.completion" and both `message` and `delta` in the choice."""
  body = _envelope(request_id, model, {"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                                       "finish_reason": finish_reason, "delta": {"role": "assistant", "content": content}})
  if usage_ is not None:
    body["usage"] = usage_
  return body


def error_chunk(request_id: str, model: str, error: ApiError) -> dict:
  """The last event of a stream that failed: an empty chunk with finish_reason "error", and the error (the openai
  client raises it as an APIError)."""
  return {**chunk(request_id, model, "", "error"), **error.body()}


def sse(body) -> bytes:
  return b"data: " + (body if isinstance(body, str) else json.dumps(body)).encode() + b"\n\n"

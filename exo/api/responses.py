"""The JSON shapes the API sends, in upstream exo's key order (clients and tests compare them verbatim)."""
import json
import time
from typing import Callable, Dict, List, Optional, Tuple

from aiohttp import web

from exo.api.errors import ApiError
from exo.helpers import VERSION
from exo.inference.sampling import TokenLogprobs


def json_reply(body: dict, status: int = 200, headers: Optional[dict] = None) -> web.Response:
  """Python json.dumps formatting (", " and ": "), as upstream: aiohttp's json_response does exactly that."""
  return web.json_response(body, status=status, headers=headers)


def error_reply(error: ApiError) -> web.Response:
  return json_reply(error.body(), error.status, error.headers)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
  return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _envelope(request_id: str, model: str, choices: List[dict]) -> dict:
  return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()), "model": model,
          "system_fingerprint": f"exo_{VERSION}", "choices": choices}


# A choice's logprobs as the API node has them: (token id, its TokenLogprobs or None where no node sent them).
TokenPairs = Optional[List[Tuple[int, Optional[TokenLogprobs]]]]
# A finished choice: (index, text, finish_reason, logprobs, tool calls or None).
ReplyChoice = Tuple[int, Optional[str], Optional[str], TokenPairs, Optional[List[dict]]]


class ChatShape:
  """Chat completions (upstream's shapes: a stream event is object "chat.completion" with both `message` and `delta`)."""

  def __init__(self, request_id: str, model: str, token_text: Callable[[int], str]):
    self.request_id, self.model, self.token_text = request_id, model, token_text

  def _token(self, token: int, logprob: float) -> dict:
    text = self.token_text(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}

  def logprobs(self, pairs: TokenPairs) -> Optional[dict]:
    if pairs is None:
      return None
    return {"content": [{**self._token(token, lp.logprob), "top_logprobs": [self._token(t, p) for t, p in lp.top]} for token, lp in pairs if lp is not None]}

  @staticmethod
  def _message(text: Optional[str], tool_calls: Optional[List[dict]]) -> dict:
    """OpenAI's assistant message: with tool calls, content is null unless the reply also has text."""
    if not tool_calls:
      return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": text or None, "tool_calls": tool_calls}

  def reply(self, choices: List[ReplyChoice], usage_: dict) -> dict:
    body = _envelope(self.request_id, self.model, [{"index": index, "message": self._message(text, tool_calls), "logprobs": self.logprobs(pairs),
                                                   "finish_reason": finish_reason} for index, text, finish_reason, pairs, tool_calls in choices])
    body["usage"] = usage_
    return body

  def chunk(self, index: int, text: str, finish_reason: Optional[str], pairs: TokenPairs = None, usage_: Optional[dict] = None,
            tool_calls: Optional[List[dict]] = None) -> dict:
    """A stream event; tool-call deltas carry each call's index, its id, type and name once, then arguments in fragments."""
    message = self._message(text, tool_calls)
    body = _envelope(self.request_id, self.model, [{"index": index, "message": message, "logprobs": self.logprobs(pairs),
                                                   "finish_reason": finish_reason, "delta": dict(message)}])
    if usage_ is not None:
      body["usage"] = usage_
    return body

  def error_chunk(self, error: ApiError) -> dict:
    """The last event of a stream that failed: an empty chunk with finish_reason "error", and the error (the openai
    client raises it as an APIError)."""
    return {**self.chunk(0, "", "error"), **error.body()}


class TextShape:
  """Legacy text completions (OpenAI's /v1/completions): object "text_completion", logprobs as parallel lists with
  each token's character offset in the choice's text."""

  def __init__(self, request_id: str, model: str, token_text: Callable[[int], str], starts: Optional[Dict[int, int]] = None):
    self.request_id, self.model, self.token_text = request_id, model, token_text
    self.offsets: Dict[int, int] = dict(starts or {})  # choice index -> where its next token's text starts (after an echoed prompt)

  def logprobs(self, index: int, pairs: TokenPairs) -> Optional[dict]:
    if pairs is None:
      return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp in pairs:
      if lp is None:
        continue
      text, offset = self.token_text(token), self.offsets.get(index, 0)
      out["tokens"].append(text)
      out["token_logprobs"].append(lp.logprob)
      out["top_logprobs"].append({self.token_text(t): p for t, p in lp.top})
      out["text_offset"].append(offset)
      self.offsets[index] = offset + len(text)
    return out

  def _body(self, choices: List[dict]) -> dict:
    return {"id": f"cmpl-{self.request_id}", "object": "text_completion", "created": int(time.time()), "model": self.model,
            "system_fingerprint": f"exo_{VERSION}", "choices": choices}

  def _choice(self, index: int, text: str, finish_reason: Optional[str], pairs: TokenPairs) -> dict:
    return {"text": text, "index": index, "logprobs": self.logprobs(index, pairs), "finish_reason": finish_reason}

  def reply(self, choices: List[ReplyChoice], usage_: dict) -> dict:
    body = self._body([self._choice(*choice[:4]) for choice in choices])
    body["usage"] = usage_
    return body

  def chunk(self, index: int, text: str, finish_reason: Optional[str], pairs: TokenPairs = None, usage_: Optional[dict] = None,
            tool_calls: Optional[List[dict]] = None) -> dict:
    body = self._body([self._choice(index, text, finish_reason, pairs)])
    if usage_ is not None:
      body["usage"] = usage_
    return body

  def error_chunk(self, error: ApiError) -> dict:
    return {**self._body([{"text": "", "index": 0, "logprobs": None, "finish_reason": "error"}]), **error.body()}


def sse(body) -> bytes:
  return b"data: " + (body if isinstance(body, str) else json.dumps(body)).encode() + b"\n\n"

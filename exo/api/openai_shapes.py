"""OpenAI chat and text completions' JSON shapes, in upstream exo's key order (clients and tests compare them
verbatim), made from the serving core's events (exo/api/events.py)."""
import time
from typing import Callable, List, Optional

from exo.api.errors import ApiError
from exo.api.events import Answer, Delta, Started, TokenLogprob, ToolCallFragment, Usage
from exo.helpers import VERSION


def usage(counts: Usage) -> dict:
  return {"prompt_tokens": counts.prompt_tokens, "completion_tokens": counts.completion_tokens, "total_tokens": counts.total_tokens}


def _envelope(request_id: str, model: str, choices: List[dict]) -> dict:
  return {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()), "model": model,
          "system_fingerprint": f"exo_{VERSION}", "choices": choices}


def _token(text: str, logprob: float) -> dict:
  return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", errors="replace"))}


def token_logprobs(logprobs: List[TokenLogprob]) -> List[dict]:
  """Each token's text, logprob and UTF-8 bytes with its alternatives (chat's `logprobs.content`; Ollama's too)."""
  return [{**_token(lp.token, lp.logprob), "top_logprobs": [_token(t, p) for t, p in lp.top]} for lp in logprobs]


def _finish_reason(delta_or_answer) -> Optional[str]:
  return delta_or_answer.finish.reason if delta_or_answer.finish is not None else None


def tool_call_deltas(fragments: List[ToolCallFragment]) -> List[dict]:
  """Stream deltas: each call's index, its id, type and name once, then its arguments in fragments."""
  return [{"index": f.call, "id": f.id, "type": "function", "function": {"name": f.name, "arguments": f.arguments}} if f.id is not None
          else {"index": f.call, "function": {"arguments": f.arguments}} for f in fragments]


class _Shape:
  def __init__(self, request_id: str, model: str):
    self.request_id, self.model = request_id, model


class ChatShape(_Shape):
  """Chat completions (upstream's shapes: a stream event is object "chat.completion" with both `message` and `delta`)."""

  @staticmethod
  def logprobs(logprobs: Optional[List[TokenLogprob]]) -> Optional[dict]:
    if logprobs is None:
      return None
    return {"content": token_logprobs(logprobs)}

  @staticmethod
  def _message(text: Optional[str], tool_calls: Optional[List[dict]], reasoning: str = "") -> dict:
    """OpenAI's assistant message: with tool calls, content is null unless the reply also has text; a reasoning
    model's thinking in `reasoning_content`, as vLLM and llama.cpp's server return it (only where there is some)."""
    message = {"role": "assistant", "content": text} if not tool_calls else {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    if reasoning:
      message["reasoning_content"] = reasoning
    return message

  def reply(self, answers: List[Answer], counts: Usage) -> dict:
    choices = []
    for a in answers:
      calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in a.calls] or None
      choices.append({"index": a.index, "message": self._message(a.content, calls, a.reasoning), "logprobs": self.logprobs(a.logprobs),
                      "finish_reason": _finish_reason(a)})
    body = _envelope(self.request_id, self.model, choices)
    body["usage"] = usage(counts)
    return body

  def chunk(self, delta: Delta) -> dict:
    message = self._message(delta.text, tool_call_deltas(delta.tool_calls) or None, delta.reasoning)
    return _envelope(self.request_id, self.model, [{"index": delta.index, "message": message, "logprobs": self.logprobs(delta.logprobs),
                                                   "finish_reason": _finish_reason(delta), "delta": dict(message)}])

  def error_chunk(self, error: ApiError) -> dict:
    """The last event of a stream that failed: an empty chunk with finish_reason "error", and the error (the openai
    client raises it as an APIError)."""
    message = self._message("", None)
    return {**_envelope(self.request_id, self.model, [{"index": 0, "message": message, "logprobs": None, "finish_reason": "error",
                                                       "delta": dict(message)}]), **error.body()}


class TextShape(_Shape):
  """Legacy text completions (OpenAI's /v1/completions): object "text_completion", logprobs as parallel lists with
  each token's character offset in the choice's text."""

  @staticmethod
  def logprobs(logprobs: Optional[List[TokenLogprob]]) -> Optional[dict]:
    if logprobs is None:
      return None
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [dict(lp.top) for lp in logprobs], "text_offset": [lp.offset for lp in logprobs]}

  def _body(self, choices: List[dict]) -> dict:
    return {"id": f"cmpl-{self.request_id}", "object": "text_completion", "created": int(time.time()), "model": self.model,
            "system_fingerprint": f"exo_{VERSION}", "choices": choices}

  def reply(self, answers: List[Answer], counts: Usage) -> dict:
    body = self._body([{"text": a.text, "index": a.index, "logprobs": self.logprobs(a.logprobs), "finish_reason": _finish_reason(a)} for a in answers])
    body["usage"] = usage(counts)
    return body

  def chunk(self, delta: Delta) -> dict:
    return self._body([{"text": delta.text, "index": delta.index, "logprobs": self.logprobs(delta.logprobs), "finish_reason": _finish_reason(delta)}])

  def error_chunk(self, error: ApiError) -> dict:
    return {**self._body([{"text": "", "index": 0, "logprobs": None, "finish_reason": "error"}]), **error.body()}


class ChunkRenderer:
  """Events to SSE chunks; with usage asked for, the chunk that ends the last choice waits for it."""

  def __init__(self, shape_of: Callable[[str], object], include_usage: bool):
    self.shape_of, self.include_usage = shape_of, include_usage
    self.shape, self.unfinished, self.held = None, 0, None

  def __call__(self, event) -> List[dict]:
    if isinstance(event, Started):
      self.shape, self.unfinished = self.shape_of(event.request_id), event.choices
      return []
    if isinstance(event, Delta):
      self.unfinished -= event.finish is not None
      chunk = self.shape.chunk(event)
      if self.include_usage and not self.unfinished:
        self.held = chunk
        return []
      return [chunk]
    if isinstance(event, Usage) and self.held is not None:
      return [{**self.held, "usage": usage(event)}]
    return []

  def error_chunk(self, error):
    return self.shape.error_chunk(error)  # (a stream has started only once there is a shape)

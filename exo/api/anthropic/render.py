"""The serving core's events in Anthropic's shapes: a message (content blocks thinking, text and tool_use, stop_reason,
usage), the stream's events (message_start, ping, content_block_start / _delta / _stop, message_delta,
message_stop), and errors ({"type": "error", "error": {"type", "message"}})."""
import json
from typing import List, Optional

from exo.api.errors import ApiError
from exo.api.events import Answer, Delta, Finish, Started, Usage

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def error_body(error: ApiError) -> dict:
  kind = ERROR_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
  return {"type": "error", "error": {"type": kind, "message": error.message}}


def message_id(request_id: str) -> str:
  return "msg_" + request_id.replace("-", "")


def tool_use_id(call_id: str) -> str:
  """The core's call ids ("call_...") as Anthropic's clients know them ("toolu_..."); either comes back the same."""
  return "toolu_" + call_id.removeprefix("call_")


def stop_reason(finish: Optional[Finish]) -> Optional[str]:
  if finish is None:
    return None
  if finish.reason == "stop":
    return "stop_sequence" if finish.stop_sequence is not None else "end_turn"
  return {"length": "max_tokens", "tool_calls": "tool_use"}[finish.reason]


def _envelope(request_id: str, model: str, content: List[dict], finish: Optional[Finish], usage: dict) -> dict:
  return {"id": message_id(request_id), "type": "message", "role": "assistant", "model": model, "content": content,
          "stop_reason": stop_reason(finish), "stop_sequence": finish.stop_sequence if finish is not None else None, "usage": usage}


def thinking_block(thinking: str) -> dict:
  """A reasoning model's thinking (its signature is empty: the node signs nothing, and takes earlier turns' thinking
  out of the prompt whatever their signature)."""
  return {"type": "thinking", "thinking": thinking, "signature": ""}


def message(request_id: str, model: str, answer: Answer, usage: Usage) -> dict:
  content = [thinking_block(answer.reasoning)] if answer.reasoning else []
  content += [{"type": "text", "text": answer.text}] if answer.text.strip() or not (answer.calls or answer.reasoning) else []
  for call in answer.calls:
    try:
      arguments = json.loads(call.arguments)
    except ValueError:
      continue  # a call cut off by max_tokens
    content.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": arguments})
  return _envelope(request_id, model, content, answer.finish, {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens})


class MessageStream:
  """Events to the stream's events: a reasoning model's thinking one thinking block (thinking_delta), each run of text
  one text block, each tool call one tool_use block whose input streams as JSON fragments."""

  def __init__(self, model: str):
    self.model = model
    self.blocks = 0  # blocks opened so far
    self.open: Optional[str] = None  # the open block's type
    self.finish: Optional[Finish] = None

  def __call__(self, event) -> List[dict]:
    if isinstance(event, Started):
      usage = {"input_tokens": event.prompt_tokens, "output_tokens": 0}
      return [{"type": "message_start", "message": _envelope(event.request_id, self.model, [], None, usage)}, {"type": "ping"}]
    if isinstance(event, Delta):
      return self._delta(event)
    if isinstance(event, Usage):
      return [{"type": "message_delta", "delta": {"stop_reason": stop_reason(self.finish), "stop_sequence": self.finish and self.finish.stop_sequence},
               "usage": {"output_tokens": event.completion_tokens}}, {"type": "message_stop"}]
    return []

  def _delta(self, delta: Delta) -> List[dict]:
    out = []
    if delta.reasoning:
      if self.open != "thinking":
        out += self._start(thinking_block(""))
      out.append(self._block_delta({"type": "thinking_delta", "thinking": delta.reasoning}))
    if delta.text:
      if self.open != "text":
        out += self._start({"type": "text", "text": ""})
      out.append(self._block_delta({"type": "text_delta", "text": delta.text}))
    for fragment in delta.tool_calls:
      if fragment.id is not None:
        out += self._start({"type": "tool_use", "id": tool_use_id(fragment.id), "name": fragment.name, "input": {}})
      if fragment.arguments:
        out.append(self._block_delta({"type": "input_json_delta", "partial_json": fragment.arguments}))
    if delta.finish is not None:
      self.finish = delta.finish
      out += self._stop()
    return out

  def _start(self, block: dict) -> List[dict]:
    out = self._stop()
    self.open, self.blocks = block["type"], self.blocks + 1
    return out + [{"type": "content_block_start", "index": self.blocks - 1, "content_block": block}]

  def _block_delta(self, delta: dict) -> dict:
    return {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}

  def _stop(self) -> List[dict]:
    if self.open is None:
      return []
    self.open = None
    return [{"type": "content_block_stop", "index": self.blocks - 1}]

"""The serving core's events in the Responses API's shapes: a response object whose output holds a reasoning item (a
reasoning model's thinking, as reasoning_text content), a message item (output_text) and function_call items, or its
stream of events (response.created, response.in_progress, response.output_item.added, response.reasoning_text.delta /
.done, response.content_part.added, response.output_text.delta / .done,
response.function_call_arguments.delta / .done, response.content_part.done, response.output_item.done, then
response.completed or, cut off by max_output_tokens, response.incomplete), each with its sequence_number."""
import time
from typing import Dict, List, Optional

from exo.api.errors import ApiError
from exo.api.events import Answer, Delta, Finish, Started, Usage


def _usage(usage: Usage) -> dict:
  return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": usage.completion_tokens,
          "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": usage.total_tokens}


def _id(prefix: str, request_id: str) -> str:
  return prefix + request_id.replace("-", "")


def _text_part(text: str) -> dict:
  return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(request_id: str, text: str, status: str) -> dict:
  return {"id": _id("msg_", request_id), "type": "message", "status": status, "role": "assistant",
          "content": [_text_part(text)] if status != "in_progress" else []}


def reasoning_item(request_id: str, text: str, status: str) -> dict:
  return {"id": _id("rs_", request_id), "type": "reasoning", "status": status, "summary": [],
          "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
  return {"id": "fc_" + call_id.removeprefix("call_"), "type": "function_call", "status": status, "call_id": call_id, "name": name,
          "arguments": arguments}


class ResponseShape:
  def __init__(self, model: str, echo: Dict[str, object]):
    self.model, self.echo = model, echo
    self.created = int(time.time())

  def body(self, request_id: str, status: str, output: List[dict], usage: Optional[Usage], finish: Optional[Finish] = None,
           error: Optional[ApiError] = None) -> dict:
    incomplete = finish is not None and finish.reason == "length"
    return {"id": _id("resp_", request_id), "object": "response", "created_at": self.created, "status": status,
            "error": {"code": error.code or error.type, "message": error.message} if error is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "model": self.model, "output": output,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False, "truncation": "disabled",
            "usage": _usage(usage) if usage is not None else None, **self.echo}

  def reply(self, request_id: str, answer: Answer, usage: Usage) -> dict:
    status = "incomplete" if answer.finish is not None and answer.finish.reason == "length" else "completed"
    output = [reasoning_item(request_id, answer.reasoning, status)] if answer.reasoning else []
    output += [message_item(request_id, answer.text, status)] if answer.text.strip() or not (answer.calls or answer.reasoning) else []
    output += [call_item(c.id, c.name, c.arguments, status) for c in answer.calls]
    return self.body(request_id, status, output, usage, answer.finish)


class ResponseStream:
  """Events to the stream's events: the message item opens at the first text, each call's item at its first
  fragment; an item closes when the next opens or the answer ends."""

  def __init__(self, shape: ResponseShape):
    self.shape = shape
    self.request_id = ""
    self.sequence = 0
    self.output: List[dict] = []  # the items so far, closed ones whole
    self.open: Optional[dict] = None  # the open item, as it stands
    self.finish: Optional[Finish] = None

  def _event(self, kind: str, **fields) -> dict:
    self.sequence += 1
    return {"type": kind, "sequence_number": self.sequence - 1, **fields}

  def __call__(self, event) -> List[dict]:
    if isinstance(event, Started):
      self.request_id = event.request_id
      body = self.shape.body(event.request_id, "in_progress", [], None)
      return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]
    if isinstance(event, Delta):
      return self._delta(event)
    if isinstance(event, Usage):
      out = [] if self.output else self._open_message()  # an answer with nothing in it still has its (empty) message
      out += self._close()
      incomplete = self.finish is not None and self.finish.reason == "length"
      body = self.shape.body(self.request_id, "incomplete" if incomplete else "completed", self.output, event, self.finish)
      return out + [self._event("response.incomplete" if incomplete else "response.completed", response=body)]
    return []

  def error_events(self, error: ApiError) -> List[dict]:
    body = self.shape.body(self.request_id, "failed", self.output, None, error=error)
    return [self._event("error", code=error.code or error.type, message=error.message, param=error.param), self._event("response.failed", response=body)]

  @property
  def _index(self) -> int:
    return len(self.output) - 1

  def _delta(self, delta: Delta) -> List[dict]:
    out = []
    if delta.reasoning:
      if self.open is None or self.open["type"] != "reasoning":
        out += self._close()
        item = reasoning_item(self.request_id, "", "in_progress")
        self.open = {**item, "text": ""}
        self.output.append(item)
        out.append(self._event("response.output_item.added", output_index=self._index, item=item))
      self.open["text"] += delta.reasoning
      out.append(self._event("response.reasoning_text.delta", item_id=self.open["id"], output_index=self._index, content_index=0, delta=delta.reasoning))
    if delta.text:
      if self.open is None or self.open["type"] != "message":
        out += self._open_message()
      self.open["text"] += delta.text
      out.append(self._event("response.output_text.delta", item_id=self.open["id"], output_index=self._index, content_index=0, delta=delta.text,
                             logprobs=[]))
    for fragment in delta.tool_calls:
      if fragment.id is not None:
        out += self._close()
        self.open = call_item(fragment.id, fragment.name, "", "in_progress")
        self.output.append(self.open)
        out.append(self._event("response.output_item.added", output_index=self._index, item=dict(self.open)))
      if fragment.arguments:
        self.open["arguments"] += fragment.arguments
        out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"], output_index=self._index, delta=fragment.arguments))
    if delta.finish is not None:
      self.finish = delta.finish
    return out

  def _open_message(self) -> List[dict]:
    out = self._close()
    item = message_item(self.request_id, "", "in_progress")
    self.open = {**item, "text": ""}
    self.output.append(item)
    return out + [self._event("response.output_item.added", output_index=self._index, item=item),
                  self._event("response.content_part.added", item_id=item["id"], output_index=self._index, content_index=0, part=_text_part(""))]

  def _close(self) -> List[dict]:
    """The open item's closing events; it takes its final form in the output."""
    item, self.open = self.open, None
    if item is None:
      return []
    status = "incomplete" if self.finish is not None and self.finish.reason == "length" else "completed"
    if item["type"] == "reasoning":
      done = reasoning_item(self.request_id, item["text"], status)
      self.output[self._index] = done
      return [self._event("response.reasoning_text.done", item_id=done["id"], output_index=self._index, content_index=0, text=item["text"]),
              self._event("response.output_item.done", output_index=self._index, item=done)]
    if item["type"] == "message":
      done = message_item(self.request_id, item["text"], status)
      self.output[self._index] = done
      part = done["content"][0]
      return [self._event("response.output_text.done", item_id=done["id"], output_index=self._index, content_index=0, text=item["text"], logprobs=[]),
              self._event("response.content_part.done", item_id=done["id"], output_index=self._index, content_index=0, part=part),
              self._event("response.output_item.done", output_index=self._index, item=done)]
    done = {**item, "status": status}
    self.output[self._index] = done
    return [self._event("response.function_call_arguments.done", item_id=done["id"], output_index=self._index, name=done["name"],
                        arguments=done["arguments"]),
            self._event("response.output_item.done", output_index=self._index, item=done)]

"""The serving core's events in Ollama's shapes: one JSON object, or newline-delimited JSON objects (the text as it
comes, tool calls whole with their arguments as objects once the answer has them, then a last object with
`done: true`, `done_reason` and the counts and durations in nanoseconds); errors as {"error": "..."}."""
import json
import time
from datetime import datetime, timezone
from typing import List, Optional

from exo.api.errors import ApiError
from exo.api.events import Answer, Delta, Started, TokenLogprob, Usage
from exo.api.ollama.models import tagged
from exo.api.openai_shapes import token_logprobs


def error_body(error: ApiError) -> dict:
  return {"error": error.message}


def now() -> str:
  return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def tool_calls(answer: Answer) -> List[dict]:
  calls = []
  for call in answer.calls:
    try:
      calls.append({"function": {"name": call.name, "arguments": json.loads(call.arguments)}})
    except ValueError:
      continue  # a call cut off by num_predict
  return calls


class OllamaReply:
  """One reply of /api/chat (`chat`: a message) or /api/generate (a `response` text), streamed or whole, timed as
  Ollama times them: load (arrival to the prompt's start), prompt evaluation (to the first token), evaluation."""

  def __init__(self, model: str, chat: bool, arrived_ns: int):
    self.model, self.chat = tagged(model), chat
    self.arrived = self.started = arrived_ns
    self.first: Optional[int] = None  # when the first token came
    self.answer = Answer(0)

  def _part(self, text: str, calls: Optional[List[dict]] = None, lps: Optional[List[TokenLogprob]] = None, done: bool = False,
            thinking: str = "") -> dict:
    """One object of the reply; a reasoning model's thinking in `thinking` (the message's, in chat), where there is some."""
    body = {"model": self.model, "created_at": now()}
    if self.chat:
      body["message"] = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {}), **({"tool_calls": calls} if calls else {})}
    else:
      body["response"] = text
      if thinking:
        body["thinking"] = thinking
    if lps is not None:
      body["logprobs"] = token_logprobs(lps)
    body["done"] = done
    return body

  def _done(self, body: dict, usage: Usage) -> dict:
    end = time.monotonic_ns()
    first = self.first or end
    finish = self.answer.finish
    return {**body, "done_reason": "length" if finish is not None and finish.reason == "length" else "stop", "total_duration": end - self.arrived,
            "load_duration": self.started - self.arrived, "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": first - self.started,
            "eval_count": usage.completion_tokens, "eval_duration": end - first}

  def note(self, event) -> None:
    if isinstance(event, Started):
      self.started = time.monotonic_ns()
    elif isinstance(event, Delta):
      self.first = self.first or time.monotonic_ns()
      self.answer.add(event)

  def __call__(self, event) -> List[dict]:
    """The stream's lines for one event."""
    self.note(event)
    if isinstance(event, Delta):
      lines = [self._part(event.text, lps=event.logprobs, thinking=event.reasoning)] if event.text or event.reasoning or event.logprobs else []
      if event.finish is not None and self.answer.calls:
        lines.append(self._part("", tool_calls(self.answer)))
      return lines
    if isinstance(event, Usage):
      return [self._done(self._part("", done=True), event)]
    return []

  def whole(self, usage: Usage) -> dict:
    """The reply not streamed (every event already noted)."""
    return self._done(self._part(self.answer.text, tool_calls(self.answer), self.answer.logprobs, done=True, thinking=self.answer.reasoning), usage)

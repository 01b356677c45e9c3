"""What the serving core gives back for a request, as an async stream: `Started` once the request holds its places
and its prompt fits, then each choice's `Delta`s (new text, a reasoning model's new thinking, tool-call fragments, logprobs, and on its last one
why it finished), then `Usage`. A failure is raised from the stream as an ApiError (before `Started`: the request
was refused; after it: the reply is cut short). Each dialect renders these in its own shapes; `collect` gathers
them for a reply that is not streamed."""
from dataclasses import dataclass, field
from typing import AsyncIterator, List, Optional, Tuple, Union

from exo.api.errors import ApiError


@dataclass(frozen=True)
class TokenLogprob:
  token: str  # the token's own text
  logprob: float
  top: List[Tuple[str, float]]  # the most likely alternatives, as asked for
  offset: int  # where the token's text starts in its choice's text, counted as the tokens' own texts (an echoed prompt first)


@dataclass(frozen=True)
class ToolCallFragment:
  """A piece of one tool call: its first piece has the call's id and name, every piece may extend its arguments
  (JSON text, whole once the call is)."""
  call: int  # the call's index within its reply
  id: Optional[str]
  name: Optional[str]
  arguments: str


@dataclass(frozen=True)
class Finish:
  reason: str  # "stop" (end of turn, a stop string, or a completed grammar), "length" or "tool_calls"
  stop_sequence: Optional[str] = None  # the stop string that ended the reply, if one did


@dataclass(frozen=True)
class Started:
  request_id: str
  prompt_tokens: int  # of all its prompts
  choices: int


@dataclass(frozen=True)
class Delta:
  index: int  # the choice's
  text: str
  logprobs: Optional[List[TokenLogprob]]  # None: not asked for
  tool_calls: List[ToolCallFragment] = field(default_factory=list)
  finish: Optional[Finish] = None  # set on the choice's last delta
  reasoning: str = ""  # new thinking of a reasoning model (exo/api/reasoning.py), apart from its answer's text


@dataclass(frozen=True)
class Usage:
  prompt_tokens: int
  completion_tokens: int  # every token generated, end tokens included

  @property
  def total_tokens(self) -> int:
    return self.prompt_tokens + self.completion_tokens


Event = Union[Started, Delta, Usage]


@dataclass
class CallSoFar:
  id: str
  name: str
  arguments: str = ""


class Answer:
  """One choice's reply, gathered from its deltas."""

  def __init__(self, index: int):
    self.index = index
    self.text = ""
    self.reasoning = ""
    self.calls: List[CallSoFar] = []
    self.logprobs: Optional[List[TokenLogprob]] = None
    self.finish: Optional[Finish] = None

  def add(self, delta: Delta) -> None:
    self.text += delta.text
    self.reasoning += delta.reasoning
    for fragment in delta.tool_calls:
      if fragment.call == len(self.calls):
        self.calls.append(CallSoFar(fragment.id, fragment.name))
      self.calls[fragment.call].arguments += fragment.arguments
    if delta.logprobs is not None:
      self.logprobs = (self.logprobs or []) + delta.logprobs
    self.finish = delta.finish or self.finish

  @property
  def content(self) -> Optional[str]:
    """The plain text: all of it, or, beside tool calls, what is not blank (else None), as OpenAI's shapes have it."""
    return (self.text.strip() or None) if self.calls else self.text


@dataclass
class Collected:
  started: Started
  answers: List[Answer]
  usage: Usage


async def collect(events: AsyncIterator[Event]) -> Collected:
  """Every event of a request, gathered per choice (the caller closes `events`)."""
  started, answers, usage = None, {}, None
  async for event in events:
    if isinstance(event, Started):
      started, answers = event, {i: Answer(i) for i in range(event.choices)}
    elif isinstance(event, Delta):
      answers[event.index].add(event)
    else:
      usage = event
  if started is None or usage is None:
    raise ApiError(500, "the reply ended before it was complete", code="generation_failed")
  return Collected(started, [answers[i] for i in sorted(answers)], usage)

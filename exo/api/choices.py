"""The choices of one request (n of them per prompt), each a request of its own in the ring: its own id, its own
admission place and random stream, its own reply text, finish reason and logprobs. They run side by side and their
deltas (exo/api/events.py) come out in the order they are ready.

A prompt's first choice starts at once; its other choices start once the first has its first token, that is once
the prompt has been prefilled, so that a node that keeps the KV of prompt prefixes computes the prompt only once."""
import asyncio
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, List, Optional, Sequence

from exo.api.admission import Ticket
from exo.api.events import Delta, Finish, TokenLogprob, ToolCallFragment
from exo.api.reasoning import ReasoningSplit
from exo.api.reply_text import ReplyText
from exo.api.tool_formats import ToolCallStream
from exo.inference.sampling import SamplingParams, TokenLogprobs
from exo.orchestration.requests import RequestEvent


@dataclass
class Choice:
  index: int
  request_id: str
  prompt: str  # what the ring is given
  params: SamplingParams
  ticket: Ticket
  kv_bytes: int  # what it may need, for admission
  reply: ReplyText
  echo: str = ""  # text the choice's reply starts with (the prompt, for echo)
  first: Optional["Choice"] = None  # the prompt's first choice, whose prefill this one waits for
  prefilled: asyncio.Event = field(default_factory=asyncio.Event)  # set at this choice's first event (or its end)
  tools: Optional[ToolCallStream] = None  # reads tool calls out of the reply, when the request allows them
  prompt_ids: Optional[List[int]] = None  # the prompt's token ids (the node routes by the blocks they make)
  thinking: Optional[ReasoningSplit] = None  # reads a reasoning model's thinking apart from its answer
  offset: int = field(init=False)  # where the next token's own text starts, for logprobs

  def __post_init__(self) -> None:
    self.offset = len(self.echo)

  @property
  def finish(self) -> Finish:
    reason = self.reply.finish_reason
    if reason == "stop" and self.tools is not None and self.tools.calls:
      return Finish("tool_calls")
    return Finish(reason, self.reply.matcher.matched_string)

  def token_logprobs(self, tokens: Sequence[int], logprobs: Optional[List[Optional[TokenLogprobs]]]) -> List[TokenLogprob]:
    """The event's tokens with their logprobs, as text (a token no node sent logprobs for is left out)."""
    out = []
    for token, lp in zip(tokens, logprobs or [None] * len(tokens)):
      if lp is None:
        continue
      text = self.reply.decode([token])
      out.append(TokenLogprob(text, lp.logprob, [(self.reply.decode([t]), p) for t, p in lp.top], self.offset))
      self.offset += len(text)
    return out


def _fragments(deltas: List[dict]) -> List[ToolCallFragment]:
  """ToolCallStream's OpenAI-shaped deltas as the core's fragments."""
  return [ToolCallFragment(d["index"], d.get("id"), d["function"].get("name"), d["function"].get("arguments", "")) for d in deltas]


_DONE = object()


async def run_choices(choices: List[Choice], events_of: Callable[[Choice], AsyncIterator[RequestEvent]]) -> AsyncIterator[Delta]:
  """Every choice's deltas until each has finished. The first failure ends them all and is raised; leaving early
  cancels the choices still running (and with them their generations in the ring)."""
  if len(choices) == 1:  # a lone choice's deltas come straight from it: no task and queue of its own per token
    async with aclosing(_deltas(choices[0], events_of)) as deltas:
      async for delta in deltas:
        yield delta
    return
  queue: asyncio.Queue = asyncio.Queue()
  tasks = [asyncio.create_task(_run(choice, events_of, queue)) for choice in choices]
  running = len(tasks)
  try:
    while running:
      item = await queue.get()
      if item is _DONE:
        running -= 1
      elif isinstance(item, BaseException):
        raise item
      else:
        yield item
  finally:
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def _run(choice: Choice, events_of: Callable[[Choice], AsyncIterator[RequestEvent]], queue: asyncio.Queue) -> None:
  try:
    async with aclosing(_deltas(choice, events_of)) as deltas:
      async for delta in deltas:
        queue.put_nowait(delta)
    queue.put_nowait(_DONE)
  except Exception as e:  # (a cancellation is not one: it comes from run_choices, which is leaving)
    queue.put_nowait(e)


async def _deltas(choice: Choice, events_of: Callable[[Choice], AsyncIterator[RequestEvent]]) -> AsyncIterator[Delta]:
  try:
    if choice.first is not None:
      await choice.first.prefilled.wait()
    await choice.ticket.admit(choice.kv_bytes)
    if choice.echo:
      yield Delta(choice.index, choice.echo, None)
    async with aclosing(events_of(choice)) as events:
      async for event in events:
        choice.prefilled.set()
        logprobs = choice.token_logprobs(event.tokens, event.logprobs) if choice.params.logprobs is not None else None
        texts = choice.reply.feed(event.tokens, event.finished)
        for i, text in enumerate(texts):
          last = choice.reply.finish_reason is not None and i == len(texts) - 1
          thinking, calls = "", []
          if choice.thinking is not None:  # before the tool calls: a call is read from the answer, never the thinking
            thinking, text = choice.thinking.feed(text, last)
          if choice.tools is not None:
            text, deltas = choice.tools.feed(text, last)
            calls = _fragments(deltas)
          # The event's logprobs go with its first delta.
          yield Delta(choice.index, text, logprobs if i == 0 or logprobs is None else [], calls, choice.finish if last else None, thinking)
        if choice.reply.finish_reason is not None:
          break  # leaving early (a stop string) cancels the rest of its generation
  finally:
    choice.ticket.leave()  # its place goes to the next choice or request at once, not when the whole request ends
    choice.prefilled.set()  # the others of its prompt never wait for a choice that has ended

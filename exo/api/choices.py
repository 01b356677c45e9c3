"""The choices of one API request (n of them per prompt), each a request of its own in the ring: its own id, its own
admission place and random stream, its own reply text, finish reason and logprobs. They run side by side and their
chunks come out in the order they are ready.

A prompt's first choice starts at once; its other choices start once the first has its first token, that is once
the prompt has been prefilled, so that a node that keeps the KV of prompt prefixes computes the prompt only once."""
import asyncio
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, List, Optional, Tuple

from exo.api.admission import Ticket
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
  logprobs: List[Tuple[int, Optional[TokenLogprobs]]] = field(default_factory=list)  # every token so far, when asked for
  first: Optional["Choice"] = None  # the prompt's first choice, whose prefill this one waits for
  prefilled: asyncio.Event = field(default_factory=asyncio.Event)  # set at this choice's first event (or its end)
  tools: Optional[ToolCallStream] = None  # reads tool calls out of the reply, when the request allows them
  prompt_ids: Optional[List[int]] = None  # the prompt's token ids (the node routes by the blocks they make)

  @property
  def text(self) -> str:
    return self.echo + self.reply.text

  @property
  def content(self) -> Optional[str]:
    """The reply's plain text: all of it, or, when it may hold tool calls, what is not a call (null if nothing)."""
    return self.tools.final_content() if self.tools is not None else self.text

  @property
  def tool_calls(self) -> Optional[List[dict]]:
    return (self.tools.tool_calls() or None) if self.tools is not None else None

  @property
  def finish_reason(self) -> Optional[str]:
    reason = self.reply.finish_reason
    return "tool_calls" if reason == "stop" and self.tools is not None and self.tools.calls else reason

  @property
  def pairs(self) -> Optional[List[Tuple[int, Optional[TokenLogprobs]]]]:
    return self.logprobs if self.params.logprobs is not None else None


@dataclass
class Chunk:
  """One piece of one choice's reply, with the logprobs of the tokens that came with it (None: not asked for) and
  the tool-call deltas it completes."""
  index: int
  text: str
  finish_reason: Optional[str]
  pairs: Optional[List[Tuple[int, Optional[TokenLogprobs]]]]
  tool_calls: Optional[List[dict]] = None


_DONE = object()


async def run_choices(choices: List[Choice], events_of: Callable[[Choice], AsyncIterator[RequestEvent]]) -> AsyncIterator[Chunk]:
  """Every choice's chunks until each has finished. The first failure ends them all and is raised; leaving early
  cancels the choices still running (and with them their generations in the ring)."""
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
    if choice.first is not None:
      await choice.first.prefilled.wait()
    await choice.ticket.admit(choice.kv_bytes)
    if choice.echo:
      queue.put_nowait(Chunk(choice.index, choice.echo, None, None))
    async with aclosing(events_of(choice)) as events:
      async for event in events:
        choice.prefilled.set()
        pairs = list(zip(event.tokens, event.logprobs or [None] * len(event.tokens))) if choice.params.logprobs is not None else None
        choice.logprobs += pairs or []
        texts = choice.reply.feed(event.tokens, event.finished)
        for i, text in enumerate(texts):
          last = choice.reply.finish_reason is not None and i == len(texts) - 1
          calls = None
          if choice.tools is not None:
            text, calls = choice.tools.feed(text, last)
          # The event's logprobs go with its first chunk.
          queue.put_nowait(Chunk(choice.index, text, choice.finish_reason if last else None, pairs if i == 0 or pairs is None else [], calls or None))
        if choice.reply.finish_reason is not None:
          break  # leaving early (a stop string) cancels the rest of its generation
    queue.put_nowait(_DONE)
  except Exception as e:  # (a cancellation is not one: it comes from run_choices, which is leaving)
    queue.put_nowait(e)
  finally:
    choice.ticket.leave()  # its place goes to the next choice or request at once, not when the whole request ends
    choice.prefilled.set()  # the others of its prompt never wait for a choice that has ended

"""The one generation path that `exo run` and the HTTP API share: prompt in, token deltas out."""
import asyncio
import uuid
from contextlib import aclosing
from typing import AsyncIterator, List, Optional, Tuple

from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.orchestration.node import Node
from exo.orchestration.passes import PROMPT_IDS
from exo.orchestration.requests import RequestEvent


class GenerationError(Exception):
  """A node in the ring failed this request; the message says which and why."""


async def generate(node: Node, base_shard: Shard, prompt: str, params: SamplingParams = SamplingParams(),
                   request_id: Optional[str] = None, timeout: float = 900.0, prompt_ids: Optional[List[int]] = None) -> AsyncIterator[Tuple[List[int], bool]]:
  """Yield (tokens, is_finished) for one request until it finishes (see `generate_events`)."""
  async with aclosing(generate_events(node, base_shard, prompt, params, request_id, timeout, prompt_ids)) as events:
    async for event in events:
      yield event.tokens, event.finished


async def generate_events(node: Node, base_shard: Shard, prompt: str, params: SamplingParams = SamplingParams(),
                          request_id: Optional[str] = None, timeout: float = 900.0, prompt_ids: Optional[List[int]] = None) -> AsyncIterator[RequestEvent]:
  """Yield one request's token events until it finishes (`prompt_ids`, where the caller has them, travel instead of
  the text). GenerationError if it failed, asyncio.TimeoutError if a token takes longer than `timeout`; leaving early
  cancels it in the ring."""
  request_id = request_id or str(uuid.uuid4())
  events = node.lifecycle.watch(request_id)
  finished, prefill = False, None

  def prefill_done(task: asyncio.Task) -> None:  # its failure is an event like the others (ends reach us at once)
    if not task.cancelled() and task.exception() is not None:
      events.put_nowait(RequestEvent([], True, str(task.exception()) or repr(task.exception())))
  try:
    await node.lifecycle.start_request(request_id, params, base_shard, prompt_ids)
    # The prompt runs beside the wait for events: an end that arrives mid-prefill reaches the client at once.
    state = {PROMPT_IDS: [int(t) for t in prompt_ids]} if prompt_ids else {}
    prefill = asyncio.ensure_future(node.process_prompt(base_shard, prompt, request_id=request_id, inference_state=state))
    prefill.add_done_callback(prefill_done)
    while not finished:
      # Not asyncio.wait_for: before Python 3.12 it drops a cancellation that lands as the event arrives.
      async with asyncio.timeout(timeout):
        event = await events.get()
      if event.error is not None:
        raise GenerationError(event.error)
      finished = event.finished
      yield event
  finally:
    node.lifecycle.unwatch(request_id)
    if not finished:
      await node.lifecycle.cancel_request(request_id)
    if prefill is not None and not prefill.done():
      prefill.cancel()
      await asyncio.gather(prefill, return_exceptions=True)

"""The one generation path that `exo run` and the HTTP API share: prompt in, token deltas out."""
import asyncio
import uuid
from typing import AsyncIterator, List, Optional, Tuple

from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.orchestration.node import Node


class GenerationError(Exception):
  """A node in the ring failed this request; the message says which and why."""


async def generate(node: Node, base_shard: Shard, prompt: str, params: SamplingParams = SamplingParams(),
                   request_id: Optional[str] = None, timeout: float = 900.0) -> AsyncIterator[Tuple[List[int], bool]]:
  """Yield (tokens, is_finished) for one request until it finishes.

  Raises GenerationError if a node reports the request failed, asyncio.TimeoutError if the prompt or any token
  takes longer than `timeout`. Leaving early (break, client gone, exception) cancels generation in the ring."""
  request_id = request_id or str(uuid.uuid4())
  events = node.watch(request_id)
  finished = False
  try:
    await node.start_request(request_id, params)
    await asyncio.wait_for(node.process_prompt(base_shard, prompt, request_id=request_id), timeout)
    while not finished:
      event = await asyncio.wait_for(events.get(), timeout)
      if event.error is not None:
        raise GenerationError(event.error)
      finished = event.finished
      yield event.tokens, finished
  finally:
    node.unwatch(request_id)
    if not finished:
      await node.cancel_request(request_id)

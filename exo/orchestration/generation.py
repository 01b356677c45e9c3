"""The one generation path that `exo run` and the HTTP API share: prompt in, token deltas out."""
import asyncio
import json
import uuid
from typing import AsyncIterator, List, Optional, Tuple

from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.orchestration.node import REQUEST_ERROR, Node


class GenerationError(Exception):
  """A node in the ring failed this request; the message says which and why."""


async def generate(node: Node, base_shard: Shard, prompt: str, params: SamplingParams = SamplingParams(),
                   request_id: Optional[str] = None, timeout: float = 900.0) -> AsyncIterator[Tuple[List[int], bool]]:
  """Yield (tokens, is_finished) for one request until it finishes.

  Raises GenerationError if a node reports the request failed, asyncio.TimeoutError if the prompt or any token
  takes longer than `timeout`. Leaving early (break, client gone, exception) cancels generation in the ring."""
  request_id = request_id or str(uuid.uuid4())
  events: asyncio.Queue = asyncio.Queue()
  name = f"generate-{request_id}"

  def on_token(rid: str, tokens: List[int], is_finished: bool) -> None:
    if rid == request_id:
      events.put_nowait((list(tokens), is_finished, None))

  def on_status(rid: str, status: str) -> None:
    if rid == request_id and REQUEST_ERROR in status:
      error = json.loads(status)
      if error.get("type") == REQUEST_ERROR:
        events.put_nowait(([], True, error.get("error", "request failed")))

  node.on_token.register(name).on_next(on_token)
  node.on_opaque_status.register(name).on_next(on_status)
  finished = False
  try:
    await node.start_request(request_id, params)
    await asyncio.wait_for(node.process_prompt(base_shard, prompt, request_id=request_id), timeout)
    while not finished:
      tokens, finished, error = await asyncio.wait_for(events.get(), timeout)
      if error is not None:
        raise GenerationError(error)
      yield tokens, finished
  finally:
    node.on_token.deregister(name)
    node.on_opaque_status.deregister(name)
    if not finished:
      await node.cancel_request(request_id)

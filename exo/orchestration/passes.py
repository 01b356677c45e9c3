"""A request's passes through this node's layers: a prompt from its first layers, a message's tensor (one request's,
or a packed step's rows, which enter the step loop as one batch), each row's turn at the model gate, and the request's
record moved on after each pass. Every way in checks the request first, so an ended request never runs again."""
import asyncio
import json
import logging
import time
import uuid
from typing import List, Optional, Tuple

import numpy as np

from exo.inference.shard import Shard
from exo.orchestration import statuses
from exo.orchestration.steps.loop import accept
from exo.orchestration.model_gate import LeftTheLine, gate_key
from exo.orchestration.requests import FirstStage, Request, RequestEnded, Status
from exo.orchestration.routing.packing import ROWS, unpack

log = logging.getLogger(__name__)

PROMPT_IDS = "prompt_ids"  # in a prompt's inference state: its token ids, so the first layers' node does not tokenise it again


class Passes:
  def __init__(self, node):
    self.node = node

  async def process_prompt(self, base_shard: Shard, prompt: str, request_id: Optional[str] = None, inference_state: Optional[dict] = {},
                           accepted: Optional[asyncio.Future] = None) -> None:
    request_id = request_id or str(uuid.uuid4())
    self.node.lifecycle.accepts_prompt(request_id)
    request = self.node.lifecycle.open_request(request_id)
    status, start = None, time.perf_counter_ns()
    try:
      shard = self.node.forwarding.route_of(request, base_shard, inference_state).shard_of(self.node.id, base_shard)
      status = {"type": "node_status", "node_id": self.node.id, "status": "start_process_prompt", "base_shard": base_shard.to_dict(),
                "shard": (shard or base_shard).to_dict(), "prompt": prompt, "request_id": request_id}
      self.node.spawn(self.node.broadcast_opaque_status(request_id, json.dumps(status)))
      if shard is None or not shard.is_first_layer():
        request.advance(Status.PREFILLING)
        accept(accepted)  # no pass here: it goes on
        await self.node.forwarding.forward_prompt(request, base_shard, prompt, inference_state)
        return
      await self._enter(request, shard)
      tokens = await self._prompt_tokens(shard, prompt, (inference_state or {}).get(PROMPT_IDS))
      request.first_stage = FirstStage(tokens.shape[1])
      context = self.context_length(request)
      if context is not None and tokens.shape[1] >= context:
        raise ValueError(f"the prompt is {tokens.shape[1]:,} tokens; this model's context is {context:,}")
      state = {k: v for k, v in (inference_state or {}).items() if k != PROMPT_IDS}  # the ids go no further than here
      await self.node.prefix_protocol.run_prompt(shard, tokens, request, state, accepted)
    except RequestEnded:
      pass
    except asyncio.CancelledError:  # the caller gave up mid-prompt (timeout, client gone)
      if self.node.lifecycle.end_request(request.id, Status.CANCELLED):
        self.node.spawn(self.node.forwarding.tell(request, request.id, statuses.CancelRequest.build(request_id=request.id)))
      raise
    except Exception as e:
      await self.node.lifecycle.fail_request(request.id, e)
      raise
    finally:
      if status is not None:
        status.update(status="end_process_prompt", elapsed_time_ns=time.perf_counter_ns() - start)
        self.node.spawn(self.node.broadcast_opaque_status(request_id, json.dumps(status)))

  async def _prompt_tokens(self, shard: Shard, prompt: str, ids) -> np.ndarray:
    """The prompt's token ids, (1, L): those it came with (tokenised once, where it arrived), else its text encoded."""
    engine = self.node.model_pool.engine_of(shard)
    if ids is None:
      return np.asarray(await engine.encode(shard, prompt)).reshape(1, -1)
    await engine.ensure_shard(shard)  # its tokenizer and context length, as encode would have loaded them
    vocab = getattr(engine.tokenizer, "vocab_size", None)
    if (not isinstance(ids, list) or not ids or not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in ids)
        or (vocab is not None and max(ids) >= vocab)):
      raise ValueError(f"{PROMPT_IDS} must list the prompt's token ids, each one in this model's vocabulary")
    return np.array(ids, dtype=np.int64).reshape(1, -1)

  async def process_tensor(self, base_shard: Shard, tensor: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None,
                           accepted: Optional[asyncio.Future] = None) -> Optional[np.ndarray]:
    """A message is one batch: a packed one (a step's rows of the stage before) or a single request's (as upstream
    nodes send). Every row is made ready (route, model gate, prefix), then all enter the step loop together."""
    packed = bool(inference_state and ROWS in inference_state)
    try:
      rows = unpack(tensor, inference_state) if packed else [(request_id or str(uuid.uuid4()), tensor, inference_state)]
    except ValueError as e:
      log.warning("exo: dropped a malformed packed message: %s", e)
      return None
    await self.process_rows(base_shard, rows, accepted, packed)

  async def process_rows(self, base_shard: Shard, rows: List[Tuple[str, np.ndarray, Optional[dict]]], accepted: Optional[asyncio.Future] = None,
                         whole: bool = True) -> None:
    """A message's rows once unpacked (those a step sends on to this node itself come as they are, never packed)."""
    arrived = [row for row in await _together([self._arrive(base_shard, *row) for row in rows]) if row is not None]
    shards = {}  # shard -> its rows (one hop's rows share one)
    for shard, row in arrived:
      shards.setdefault(shard, []).append(row)
    await _together([self._run_batch(shard, batch, accepted, whole) for shard, batch in shards.items()])

  async def _arrive(self, base_shard: Shard, request_id: str, tensor: np.ndarray, state: Optional[dict]) -> Optional[tuple]:
    """A row of a message, made ready for its pass here: (shard, (request id, tensor, state)), or None if it does not run."""
    request = self.node.lifecycle.open_request(request_id)
    if request is None:  # a hop still in flight when the request ended: going on would revive it
      return None
    try:
      shard = self.node.forwarding.route_of(request, base_shard, state).shard_of(self.node.id, base_shard)
      if shard is None:
        raise ValueError(f"node {self.node.id} is not on the route of request {request.id} ({request.route.group})")
      await self._enter(request, shard)
      if not await self.node.prefix_protocol.start_here(shard, request, state):
        return None
      self.node.prefix_protocol.fed_back(request, tensor)
      self.node.forwarding.fed_back(request, shard, tensor)
      return shard, (request.id, tensor, state)
    except RequestEnded:
      return None
    except Exception as e:
      await self.node.lifecycle.fail_request(request.id, e)
      return None

  async def _run_batch(self, shard: Shard, rows: List[Tuple[str, np.ndarray, Optional[dict]]], accepted: Optional[asyncio.Future], whole: bool) -> None:
    """A message's rows into the step loop together (`whole`: a step of the stage before, due at once)."""
    results = await self.node.steps.run(shard, rows, accepted, whole)
    for (request_id, _, _), result in zip(rows, results):
      if isinstance(result, Exception) and not isinstance(result, RequestEnded):
        await self.node.lifecycle.fail_request(request_id, result)

  async def _enter(self, request: Request, shard: Shard) -> None:
    """Wait until this node's engine serves the request's layers (ModelGate); all its messages wait for its one turn."""
    if request.admitted is None:  # its first work here
      request.model = shard.model_id
      self.node.model_pool.expect(shard)
      request.admitted = asyncio.ensure_future(self.node.model_gate.enter(request.id, gate_key(shard)))
      # Its waiters may all be gone (cancelled) when it ends in an error: that error is no one's to log.
      request.admitted.add_done_callback(lambda admitted: admitted.cancelled() or admitted.exception())
    try:
      await asyncio.shield(request.admitted)
    except LeftTheLine:
      raise RequestEnded(request.id) from None
    request.engine = self.node.model_pool.engine_of(shard)
    request.advance(Status.PREFILLING)

  def passed(self, shard: Shard, request: Request, positions: int, state: Optional[dict]) -> Optional[dict]:
    """After a pass of `positions` positions: the request's record moves on; the state its result goes on with."""
    if not self.node.requests.is_live(request.id):  # it ended while the pass ran, which may have made a cache again
      self.node.lifecycle.release_cache(request.id, request.engine)
      raise RequestEnded(request.id)
    state = self.node.prefix_protocol.ran(shard, request, state)
    request.positions += positions
    request.advance(Status.DECODING)
    return state

  def context_length(self, request: Request) -> Optional[int]:
    return (request.engine or self.node.inference_engine).context_length


async def _together(coroutines: list) -> list:
  """The coroutines' results, run concurrently; a lone one (the usual case) awaited in place, not a turn later as a task."""
  if len(coroutines) == 1:
    return [await coroutines[0]]
  return await asyncio.gather(*coroutines)

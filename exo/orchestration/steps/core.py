"""The step core: what a stage's step leaves behind, one StepOutput per step, sent at once by `Forwarding.send` (one
SendTensor per next hop, one token message per origin). After each forward pass the step loop runs `finishing_for`:
on the last layers the rows' tokens drawn together, then each row through `Node.process_inference_result` (whose core
implementation calls `add`) into the step's output."""
import asyncio
import contextvars
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from exo.inference import constrained
from exo.inference.grammar import Constraint, MaskTimes
from exo.inference.inference_engine import InferenceEngine
from exo.inference.sampling import SamplingParams, TokenLogprobs
from exo.inference.shard import Shard
from exo.inference.tokenizers import eos_ids
from exo.logs import VERBOSE
from exo.orchestration.steps.scheduler import BatchStats
from exo.orchestration.requests import Request, RequestEnded
from exo.topology.placement import Stage

log = logging.getLogger(__name__)

PackedRow = Tuple[str, np.ndarray, Optional[dict]]  # request id, its tensor (1, L, ...), the inference state it travels with
StepRow = Tuple[str, int, np.ndarray, Optional[dict]]  # a row a step finished: request id, positions it ran, result, state


@dataclass
class Hop:
  """The rows of one step bound to one next hop, sent as one message (or one message each where they cannot be packed:
  requests without a travelling route to another node, which may be an upstream one)."""
  to: Stage
  shard: Shard
  packable: bool
  rows: List[PackedRow] = field(default_factory=list)


@dataclass
class Token:
  """A token sampled here, with what its request's origin and route must learn of it."""
  request: Request
  token: int
  finished: bool
  logprobs: Optional[TokenLogprobs]


@dataclass
class StepOutput:
  hops: Dict[tuple, Hop] = field(default_factory=dict)  # (next node, its shard, dtype, row shape) -> the rows for it
  tokens: List[Token] = field(default_factory=list)  # in the order they were sampled
  finished: List[str] = field(default_factory=list)  # request ids that finished in this step
  failed: List[Tuple[str, BaseException]] = field(default_factory=list)
  sampled: Dict[str, Union[int, Exception]] = field(default_factory=dict)  # tokens the step drew together, until `add` takes them


# The output of the step under way in this task, while its rows are added (see StepCore.finish_step).
CURRENT: contextvars.ContextVar[Optional[StepOutput]] = contextvars.ContextVar("exo_step_output", default=None)


class StepCore:
  """Turns the results of a node's forward passes into step outputs."""

  def __init__(self, node):
    self.node = node  # its public parts: requests, model pool, passes (sampler, budget, bookkeeping), forwarding, steps, the hook
    self.sampling_stats = BatchStats()  # rows per sampling call
    self.mask_times = MaskTimes()  # grammar masks computed during steps

  def finishing_for(self, scheduler, step):
    """What finishes a step's rows, right after its forward pass: on the last layers their sampling (grammar masks
    computed meanwhile on the grammar threads), then one output for all of them."""
    shard, masks, node = scheduler.shard, None, self.node
    if shard.is_last_layer():
      finishing = [node.requests.get(row.request_id) for row, take in step.rows if take == row.length]
      finishing = [r for r in finishing if r is not None]
      masks = asyncio.ensure_future(self._masks(shard, finishing)) if any(r.params.grammar for r in finishing) else None

    async def finish(done):
      rows = [(row.request_id, row.received, result[0], result[1]) for row, result in done if not isinstance(result, BaseException)]
      sampled = await self._sample(shard, rows, masks) if shard.is_last_layer() else {}
      if shard.is_first_layer() and shard.is_last_layer():
        try:
          self._run_ahead(shard, rows, sampled)
        except Exception as e:  # an optimisation: the rows go on as without it
          log.warning("exo: no step run ahead: %r", e)
      output = await self.finish_step(shard, rows, sampled)
      coming_back = [row[0] for hop in output.hops.values() if hop.to.node_id == node.id for row in hop.rows]

      def send() -> None:
        node.steps.expect(coming_back)
        node.forwarding.send(output)
      return send
    return finish

  def _run_ahead(self, shard: Shard, rows: List[StepRow], sampled: Dict[str, Union[int, Exception]]) -> None:
    """The next step of the rows that go on decoding here, started now (steps/ahead.py): only where the core's
    `process_inference_result` is the hook's one implementation (it decides what follows a token), and only if every
    row that comes back here can go (a row left out would need a step of its own beside the one started). If every
    one of them is greedy and far from its token limit, the step after it may be chained on the engine's thread."""
    node, ahead, follow = self.node, [], {}
    if not node.steps.can_run_ahead(shard):
      return
    if any(node.plugins.get_name(impl.plugin) != "exo-core" for impl in node.plugins.hook.exo_process_inference_result.get_hookimpls()):
      return
    engine = node.model_pool.engine_of(shard)
    context = engine.context_length
    for request_id, received, _, _ in rows:
      request, token = node.requests.get(request_id), sampled.get(request_id)
      if request is None or not node.requests.is_live(request_id):
        continue  # it does not come back
      route = request.route
      if route is None or route.after(node.id).node_id != node.id or route.shard(route.after(node.id), shard) != shard:
        continue  # its next step is another node's
      if not isinstance(token, (int, np.integer)) or request.params.grammar or request.sampled_here().constraint is not None:
        return  # (its token is not known, or a grammar decides whether it ends)
      sampling, positions = request.sampled_here(), request.positions + received
      if self._ends_with(request, engine, int(token), len(sampling.tokens) + 1, positions):
        continue
      ahead.append((request_id, np.array([[token]], dtype=np.int64)))
      params = request.params
      if (params.temperature <= 0 and constrained.drawn_as_is(params) and len(sampling.tokens) + 2 < self.token_limit(request)
              and (context is None or positions + 2 < context)):  # its next token is the engine's argmax, and not its last by count
        follow[request_id] = frozenset() if params.ignore_eos else frozenset(sampling.eos_ids)
    if ahead:
      argmax = getattr(engine.sample_batch, "__func__", None) is InferenceEngine.sample_batch  # the engine draws a greedy row as its thread would
      node.steps.ahead.start(engine, shard, ahead, follow if argmax and len(follow) == len(ahead) else None)

  async def _masks(self, shard: Shard, requests) -> Dict[str, np.ndarray]:
    prepared = await constrained.prepare(requests, self.node.model_pool.engine_of(shard).tokenizer)
    ready = [(r.id, c) for r, c in zip(requests, prepared) if isinstance(c, Constraint)]
    masks = await constrained.masks_of([c for _, c in ready], self.mask_times)
    return {request_id: mask for (request_id, _), mask in zip(ready, masks)}

  async def _sample(self, shard: Shard, rows: List[StepRow], masks: Optional[asyncio.Future]) -> Dict[str, Union[int, Exception]]:
    """The token of each live row from its logits, with its own parameters, random stream and grammar
    (inference/constrained.py; a grammar this node cannot follow gives an error in place of the token), drawn in one
    vectorised call; if that fails, each row alone, so that a bad row fails alone."""
    # A request that ended while its step ran (error, cancel, stop) must not be revived by its token.
    live = [(request_id, logits) for request_id, _, logits, _ in rows if self.node.requests.is_live(request_id)]
    try:
      ready = await masks if masks is not None else {}
    except Exception:  # whatever failed is met again, and reported per row, when the rows are sampled
      ready = {}
    if not live:
      return {}
    self.sampling_stats.record(len(live))
    log.debug("[batching] sampled %d request(s) together on %s; sampling: %s", len(live), shard.model_id, self.sampling_stats)
    requests = [self.node.requests.get(request_id) or Request(request_id, SamplingParams()) for request_id, _ in live]  # (an ended one's token is dropped)
    engine, saved = self.node.model_pool.engine_of(shard), [r.sampled_here().generator.bit_generator.state for r in requests]

    async def draw(picked: List[int]) -> List[Union[int, Exception]]:
      return await constrained.sample_requests(engine, [requests[i] for i in picked], [live[i][1] for i in picked], f"node {self.node.id}",
                                               [ready.get(live[i][0]) for i in picked], self.mask_times, [self.tokens_left(requests[i]) for i in picked])
    try:
      return dict(zip([r.id for r in requests], await draw(list(range(len(live))))))
    except Exception as e:
      if len(live) == 1:
        return {live[0][0]: e}
      log.log(VERBOSE, "[batching] sampling %d rows together failed (%r); sampling each alone", len(live), e)
    tokens: Dict[str, Union[int, Exception]] = {}
    for i, request in enumerate(requests):
      request.sampled_here().generator.bit_generator.state = saved[i]  # the failed call must not move anyone's random stream
      try:
        tokens[request.id] = (await draw([i]))[0]
      except Exception as e:
        tokens[request.id] = e
    return tokens

  async def finish_step(self, shard: Shard, rows: List[StepRow], sampled: Dict[str, Union[int, Exception]]) -> StepOutput:
    """Every row a step finished, through `process_inference_result` into one output."""
    output = StepOutput(sampled=sampled)
    reset = CURRENT.set(output)
    try:
      for request_id, positions, result, state in rows:
        request = self.node.requests.get(request_id)
        if request is None:
          continue
        try:
          state = self.node.passes.passed(shard, request, positions, state)
          await self.node.process_inference_result(shard, result, request_id, state)
        except RequestEnded:
          pass
        except Exception as e:
          output.failed.append((request_id, e))
    finally:
      CURRENT.reset(reset)
    return output

  def token_limit(self, request: Request) -> int:
    return min(request.params.max_tokens or self.node.max_generate_tokens, self.node.max_generate_tokens)

  def tokens_left(self, request: Request) -> int:
    """The tokens a request may still be given here, the one about to be sampled included."""
    left = self.token_limit(request) - len(request.sampled_here().tokens)
    context = self.node.passes.context_length(request)
    return left if context is None else min(left, context - request.positions)

  async def add(self, shard: Shard, result: np.ndarray, request_id: str, state: Optional[dict]) -> None:
    """One row's outcome, into the output of the step under way (outside a step, an output of its own, its token drawn
    as a step's are, sent at once)."""
    in_step = CURRENT.get()
    output = in_step or StepOutput(sampled=await self._sample(shard, [(request_id, 0, result, state)], None) if shard.is_last_layer() else {})
    await self._add(output, shard, result, request_id, state)
    if in_step is None:
      self.node.forwarding.send(output)
      for _, error in output.failed:
        raise error

  async def _add(self, output: StepOutput, shard: Shard, result: np.ndarray, request_id: str, state: Optional[dict]) -> None:
    node = self.node
    request = node.requests.get(request_id)
    if request is None:  # it ended while its pass ran
      return
    if not shard.is_last_layer():
      self._hop(output, shard, request, result, state)
      return
    token = output.sampled.pop(request_id, None)
    if token is None:  # it ended before the step drew its token
      return
    if isinstance(token, Exception):
      output.failed.append((request_id, token))
      return
    if not node.requests.is_live(request_id):  # it ended while it was being sampled
      return
    sampling = request.sampled_here()
    sampling.tokens.append(token)
    logprobs, sampling.logprobs = sampling.logprobs, None
    engine = node.model_pool.engine_of(shard)  # the engine of the request's model (ModelPool), so its tokenizer is the request's
    finished = self._ends_with(request, engine, token, len(sampling.tokens), request.positions)
    log.debug("[%s] token %d (%d/%d) finished=%s", request_id, token, len(sampling.tokens), self.token_limit(request), finished)  # (the cluster tests read it)
    if finished:
      output.finished.append(request_id)
    else:
      self._hop(output, shard, request, np.array([[token]], dtype=np.int64), state)
    output.tokens.append(Token(request, token, finished, logprobs))

  def _ends_with(self, request: Request, engine, token: int, tokens: int, positions: int) -> bool:
    """Whether the request ends with `token`, once it has `tokens` tokens sampled here and `positions` run."""
    sampling = request.sampled_here()
    if sampling.eos_ids is None:
      sampling.eos_ids = eos_ids(engine.tokenizer)
    context = engine.context_length
    return ((token in sampling.eos_ids and not request.params.ignore_eos) or tokens >= self.token_limit(request)
            or (context is not None and positions >= context) or (sampling.constraint is not None and sampling.constraint.finished))

  def _hop(self, output: StepOutput, shard: Shard, request: Request, tensor: np.ndarray, state: Optional[dict]) -> None:
    """The row into its next hop's message: rows that travel with their route, or come back here, are packed together."""
    route = request.route
    if route is None:
      return
    to, tensor = route.after(self.node.id), np.asarray(tensor)
    shard, packable = route.shard(to, shard), route.travels or to.node_id == self.node.id
    key = (to.node_id, shard, tensor.dtype.str, tensor.shape[2:]) if packable else (to.node_id, shard, request.id)
    output.hops.setdefault(key, Hop(to, shard, packable)).rows.append((request.id, tensor, self.node.forwarding.outgoing(request, state, to)))

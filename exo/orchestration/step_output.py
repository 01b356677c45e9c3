"""What a stage's step leaves behind, and how it is made: one StepOutput per step, sent at once.

A step's rows (a batch of one on a node without batching) each end in one of four ways: their hidden states (or, past
the last layers, their new token) go on to the next hop of their route, their token goes to their origin, they
finish, or they fail. `StepCore.add` puts one row's outcome into the step's output (`Node.process_inference_result`,
through the `exo_process_inference_result` hook, is what calls it); `StepCore.finish_step` runs that for every row of
a step inside the step's output; `Forwarding.send` sends an output: one SendTensor per next hop (a step's rows for one
hop packed together, routing/packing.py), one token message per origin, SendResult as upstream exo for requests
without a travelling route."""
import contextvars
import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from exo.inference.sampling import TokenLogprobs
from exo.inference.shard import Shard
from exo.inference.tokenizers import eos_ids
from exo.orchestration.requests import Request, RequestEnded
from exo.topology.placement import Stage

log = logging.getLogger(__name__)

PackedRow = Tuple[str, np.ndarray, Optional[dict]]  # request id, its tensor (1, L, ...), the inference state it travels with


@dataclass
class Hop:
  """The rows of one step bound to one next hop, sent as one message (or one message each where they cannot be packed:
  requests without a travelling route, which upstream nodes may receive, and hops to this node itself)."""
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
  whole_steps: bool = False  # a batching step's: its rows go packed even alone, so the next stage knows the step is all there

  def hop(self, to: Stage, shard: Shard, row: PackedRow, packable: bool) -> None:
    tensor = np.asarray(row[1])
    key = (to.node_id, shard, tensor.dtype.str, tensor.shape[2:]) if packable else (to.node_id, shard, row[0])
    self.hops.setdefault(key, Hop(to, shard, packable)).rows.append(row)


# The output of the step under way in this task, while its rows are added (see StepCore.finish_step).
CURRENT: contextvars.ContextVar[Optional[StepOutput]] = contextvars.ContextVar("exo_step_output", default=None)


class StepCore:
  """Turns the results of a node's forward passes into step outputs. Handed what it needs: the request records, the
  engine (tokenizer and context length), the sampler, the route's next hop with the state it carries, the token budget,
  and the bookkeeping after a pass."""

  def __init__(self, node):
    self.node = node  # its public parts: requests, model pool, passes (sampler, budget, bookkeeping), forwarding, the hook

  async def add(self, shard: Shard, result: np.ndarray, request_id: str, state: Optional[dict]) -> None:
    """One row's outcome, into the output of the step under way (or, outside a step, an output of its own, sent at
    once: a batch of one). On the last layers its token is the one its step drew, else it is sampled alone here."""
    in_step = CURRENT.get()
    output = in_step or StepOutput()
    await self._add(output, shard, result, request_id, state)
    if in_step is None:
      self.node.forwarding.send(output)
      for _, error in output.failed:
        raise error

  async def finish_step(self, shard: Shard, rows: List[Tuple[str, int, np.ndarray, Optional[dict]]],
                        sampled: Optional[Dict[str, Union[int, Exception]]] = None) -> StepOutput:
    """Every row a step finished (request id, positions it ran, result, state), each through
    `Node.process_inference_result` into one output, which the caller sends."""
    output = StepOutput(sampled=dict(sampled or {}), whole_steps=True)
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

  async def _add(self, output: StepOutput, shard: Shard, result: np.ndarray, request_id: str, state: Optional[dict]) -> None:
    node = self.node
    request = node.requests.get(request_id)
    if request is None:  # it ended while its pass ran
      return
    if not shard.is_last_layer():
      self._hop(output, shard, request, result, state)
      return
    token = output.sampled.pop(request_id, None)
    if token is None:
      token = (await node.passes.sample_tokens(shard, [result], [request_id]))[0]
    if isinstance(token, Exception):
      output.failed.append((request_id, token))
      return
    if not node.requests.is_live(request_id):  # it ended while it was being sampled
      return
    sampling = request.sampled_here()
    sampling.tokens.append(token)
    logprobs, sampling.logprobs = sampling.logprobs, None
    engine = node.model_pool.engine_of(shard)  # the engine of the request's model (ModelPool), so its tokenizer is the request's
    if sampling.eos_ids is None:
      sampling.eos_ids = eos_ids(engine.tokenizer)
    limit, context = node.passes.token_limit(request), engine.context_length
    finished = ((token in sampling.eos_ids and not request.params.ignore_eos) or len(sampling.tokens) >= limit
                or (context is not None and request.positions >= context) or (sampling.constraint is not None and sampling.constraint.finished))
    log.debug("[%s] token %d (%d/%d) finished=%s", request_id, token, len(sampling.tokens), limit, finished)  # (the cluster tests read it)
    if finished:
      output.finished.append(request_id)
    else:
      self._hop(output, shard, request, np.array([[token]], dtype=np.int64), state)
    output.tokens.append(Token(request, token, finished, logprobs))

  def _hop(self, output: StepOutput, shard: Shard, request: Request, tensor: np.ndarray, state: Optional[dict]) -> None:
    route, forwarding = request.route, self.node.forwarding
    if route is None:
      return
    to = route.after(self.node.id)
    output.hop(to, route.shard(to, shard), (request.id, tensor, forwarding.outgoing(request, state, to)),
               packable=route.travels and to.node_id != self.node.id)

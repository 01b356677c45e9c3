"""The batching plugin: the hook implementations that let concurrent requests share work on this node.

Forward passes (exo_infer_tensor): the engine's step loop runs the steps each shard's Scheduler decides (several
requests per step, micro-batches in flight round the ring). Sampling on the last layer
(exo_process_inference_result): the requests whose logits one step produced are sampled together in one
vectorised call (`node.sample_tokens`, each row with its own parameters and random stream) as soon as the last of
them arrives, then each token goes through `node.handle_token` exactly as it would unbatched. Every request still
travels the ring as its own message, so nodes without this plugin (or upstream exo nodes) share the ring unchanged.

Neither waits for requests that cannot come: a step waits only for requests of its own group that are still
going, a sampling call only for the rows of its own step that have not reached sampling yet (`to_sample`). Both
forget a request the moment it ends."""
import asyncio
import math
import sys
import time
from collections import defaultdict
from typing import Dict, List, Optional, Set, Tuple, Union

import numpy as np

from exo.helpers import DEBUG
from exo.inference.sampling import make_generator
from exo.inference.shard import Shard
from exo.orchestration.batching.batcher import Batcher, BatchStats
from exo.orchestration import statuses
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.micro_batches import StepCost
from exo.orchestration.hookspecs import hookimpl
from exo.orchestration.batching.scheduler import Row, Scheduler, Step
from exo.orchestration.batching.step_loop import StepLoop

PLUGIN_NAME = "exo-batching"
STAGE_REPORT_S = 1.0  # how often a stage tells the others what its steps take
STAGE_TIMING_FRESH_S = 10.0  # a stage's report older than this is not used

SampleItem = Tuple[np.ndarray, str, Optional[dict]]  # logits, request id, inference state
SampleKey = Tuple[Shard, int]  # the shard and the step whose rows are sampled together


class BatchingPlugin:
  def __init__(self, node, config: BatchingConfig):
    self.node, self.config = node, config
    self.sampler: Batcher[SampleKey, SampleItem, None] = Batcher(self._sample_group, config.batch_size, config.timeout_ms / 1000, self._nothing_else_coming)
    self.steps = StepLoop(node.inference_engine, self._new_scheduler, node.requests.is_live, self._step_done)
    self.to_sample: Dict[SampleKey, Set[str]] = defaultdict(set)  # rows of a last-shard step not yet in sampling
    self.sampled_with: Dict[str, SampleKey] = {}  # request id -> the step it is sampled with
    self.stage_costs: Dict[Tuple[str, str], Tuple[StepCost, float]] = {}  # (node id, model) -> its stage's step cost, when heard
    self._reported: Dict[Shard, float] = {}  # when each of our stages last told the others its step cost
    self._steps_done = 0
    node.inbox.observe(statuses.STAGE_TIMING, self._heard_stage_timing)

  # --- hooks ---

  @hookimpl
  def exo_infer_tensor(self, node, shard, tensor, request_id, inference_state, accepted):
    return self.steps.infer(shard, request_id, tensor, inference_state, accepted)

  @hookimpl
  def exo_process_inference_result(self, node, shard, result, request_id, inference_state):
    if not shard.is_last_layer():
      return None  # hidden states go on to the next node as they are
    return self._sample(shard, result, request_id, inference_state)

  @hookimpl(wrapper=True, specname="exo_process_inference_result")
  def account_for_inference_result(self, node, shard, result, request_id, inference_state):
    handled = yield
    return self._then_account(shard, request_id, handled)

  @hookimpl
  def exo_request_ended(self, node, request_id):
    self.steps.forget(request_id)
    self._not_sampled(request_id)

  @hookimpl
  def exo_node_stopping(self, node):
    return self.stop()

  @hookimpl
  def exo_run_summary(self, node):
    if not self.sampler.stats.flushes and not self.step_stats().flushes:
      return None
    return f"mean batch size {self.sampler.stats.mean:.1f} (sampling), {self.step_stats().mean:.1f} (engine steps)"

  # --- forward passes ---

  @property
  def schedulers(self) -> Dict[Shard, Scheduler]:
    return self.steps.schedulers

  def _new_scheduler(self, shard: Shard) -> Scheduler:
    scheduler = Scheduler(shard, self.config.batch_size, self.config.timeout_ms / 1000, self.config.prefill_chunk)
    scheduler.stages = len(self.node.ring_ids(shard))
    return scheduler

  def _step_done(self, scheduler: Scheduler, step: Step, done: List[Tuple[Row, object]]) -> None:
    """After each step: its rows on the last layers are sampled together; the ring's size is kept current."""
    self._steps_done += 1
    scheduler.stages = len(self.node.ring_ids(scheduler.shard))
    self._report(scheduler)
    if scheduler.shard.is_first_layer():
      scheduler.other_stages = self._other_stages(scheduler)
    if scheduler.shard.is_last_layer():
      key = (scheduler.shard, self._steps_done)
      for row, result in done:
        if not isinstance(result, BaseException) and self.node.requests.is_live(row.request_id):
          self.to_sample[key].add(row.request_id)
          self.sampled_with[row.request_id] = key

  # --- what the other stages take (for the number of micro-batches) ---

  def _report(self, scheduler: Scheduler) -> None:
    """Every STAGE_REPORT_S, tell the ring what this stage's decode steps take (a status old nodes ignore)."""
    now, cost = time.monotonic(), scheduler.times.cost()
    if cost is None or not self.node.peers or now - self._reported.get(scheduler.shard, -math.inf) < STAGE_REPORT_S:
      return
    self._reported[scheduler.shard] = now
    status = statuses.stage_timing(self.node.id, scheduler.shard, cost.fixed_s, cost.per_row_s, scheduler.times.busy_fraction(now))
    self.node.spawn(self.node.broadcast_opaque_status("", status))

  def _heard_stage_timing(self, request_id: str, status: dict, sender_host: Optional[str]) -> None:
    if status["node_id"] != self.node.id:
      self.stage_costs[(status["node_id"], status["shard"]["model_id"])] = (StepCost(status["fixed_s"], status["per_row_s"]), time.monotonic())

  def _other_stages(self, scheduler: Scheduler) -> List[StepCost]:
    """The other stages' step costs, heard within STAGE_TIMING_FRESH_S; [] unless every one of them is known."""
    now, model = time.monotonic(), scheduler.shard.model_id
    heard = [self.stage_costs.get((node_id, model)) for node_id in self.node.ring_ids(scheduler.shard) if node_id != self.node.id]
    if not heard or any(h is None or now - h[1] > STAGE_TIMING_FRESH_S for h in heard):
      return []
    return [cost for cost, _ in heard]

  def _not_sampled(self, request_id: str) -> None:
    """The request will not reach sampling (it ended or failed on the way): its step's other rows stop waiting."""
    key = self.sampled_with.pop(request_id, None)
    if key is not None and request_id in self.to_sample.get(key, ()):
      self.to_sample[key].discard(request_id)
      if not self.to_sample[key]:
        del self.to_sample[key]
      self.sampler.poke(key)

  async def _then_account(self, shard: Shard, request_id: str, handled):
    try:
      if handled is not None:
        await handled
    finally:
      self._not_sampled(request_id)

  def step_stats(self) -> BatchStats:
    stats = BatchStats()
    for scheduler in self.schedulers.values():
      stats.sizes.update(scheduler.stats.sizes)
    return stats

  # --- sampling ---

  async def _sample(self, shard: Shard, result: np.ndarray, request_id: str, inference_state: Optional[dict]) -> None:
    key = self.sampled_with.pop(request_id, (shard, 0))  # (step 0: not from a step of this node; gathered by timeout)
    waiting = self.to_sample.get(key)
    if waiting is not None:
      waiting.discard(request_id)
      if not waiting:
        del self.to_sample[key]
    await self.sampler.submit(key, (result, request_id, inference_state))

  def _nothing_else_coming(self, key: SampleKey, waiting: int) -> bool:
    return key[1] != 0 and not self.to_sample.get(key)

  async def _sample_group(self, key: SampleKey, items: List[SampleItem]) -> List[Optional[BaseException]]:
    node, shard = self.node, key[0]
    # A request that ended while it waited (error, cancel, stop) must not be revived by its token.
    live = [item for item in items if node.requests.is_live(item[1])]
    tokens = dict(zip((item[1] for item in live), await self._sample_rows(shard, [item[0] for item in live], [item[1] for item in live])))
    outcomes: List[Optional[BaseException]] = []
    for _, request_id, state in items:
      token = tokens.get(request_id)
      try:
        if isinstance(token, BaseException):
          raise token
        if token is not None:
          node.handle_token(shard, token, request_id, state)
        outcomes.append(None)
      except Exception as e:  # this request ends with its error; the others carry on
        outcomes.append(e)
    if DEBUG >= 2:
      print(f"[batching] sampled {len(live)} request(s) together on {shard.model_id}; sampling: {self.sampler.stats}")
    return outcomes

  async def _sample_rows(self, shard: Shard, results: List[np.ndarray], request_ids: List[str]) -> List[Union[int, BaseException]]:
    """One vectorised call for every row; if it fails, each row on its own so that a bad row fails alone."""
    if not results:
      return []
    states = [self.node.requests.get(request_id) for request_id in request_ids]
    for state in states:
      if state.generator is None:
        state.generator = make_generator(state.params.seed)
    saved = [state.generator.bit_generator.state for state in states]
    try:
      return list(await self.node.sample_tokens(shard, results, request_ids))
    except Exception as e:
      if len(results) == 1:
        return [e]
      if DEBUG >= 1:
        print(f"[batching] sampling {len(results)} rows together failed ({e!r}); sampling each alone")
    tokens: List[Union[int, BaseException]] = []
    for state, generator_state, result, request_id in zip(states, saved, results, request_ids):
      state.generator.bit_generator.state = generator_state  # the failed call must not move anyone's random stream
      try:
        tokens.append((await self.node.sample_tokens(shard, [result], [request_id]))[0])
      except Exception as e:
        tokens.append(e)
    return tokens

  # --- lifecycle ---

  async def stop(self) -> None:
    """Steps under way finish; requests still waiting for a step or a sampling batch end with an error."""
    await self.steps.stop()
    await self.sampler.stop()
    for _ in range(3):  # let the requests just failed reach their error handlers while the node still runs
      await asyncio.sleep(0)
    if DEBUG >= 2:
      print(f"[batching] stopped; sampling: {self.sampler.stats}; engine steps: {self.step_stats()}")


def register_batching(node, config: BatchingConfig) -> BatchingPlugin:
  """Turn batching on for `node` (the CLI calls this when EXO_BATCH_SIZE / --batch-size is 2 or more)."""
  plugin = BatchingPlugin(node, config)
  node.plugins.register(plugin, name=PLUGIN_NAME)
  print(f"exo: {config.describe()}", file=sys.stderr, flush=True)
  return plugin

"""The batching plugin: the hook implementations that let concurrent requests share work on this node.

Forward passes (exo_infer_tensor): the engine's step loop runs the steps each shard's Scheduler decides (several
requests per step, micro-batches in flight round the ring). What follows a step happens inside it, for all its rows
at once: on the last layers they are sampled together in one vectorised call (`node.passes.sample_tokens`, each row with its
own parameters, random stream and grammar; rows that follow a grammar have their masks computed on the grammar threads
while the step's forward pass runs); then the node's step core (exo/orchestration/step_output.py) passes every row
through `Node.process_inference_result` into one output, and the output is sent: one message per next hop, one token
message per origin. Requests without a travelling route (rings with upstream nodes) still go as one message each,
so nodes without this plugin (or upstream exo nodes) share the ring unchanged.

A step waits only for requests of its own group that are still going; nothing waits for a request that has
ended."""
import asyncio
import logging
import math
import time
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from exo.inference import constrained
from exo.inference.grammar import Constraint, MaskTimes
from exo.inference.shard import Shard
from exo.logs import VERBOSE
from exo.orchestration import statuses
from exo.orchestration.batching.batcher import BatchStats
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.micro_batches import StepCost
from exo.orchestration.batching.scheduler import Scheduler, Step
from exo.orchestration.batching.step_loop import Done, StepLoop
from exo.orchestration.hookspecs import hookimpl

log = logging.getLogger(__name__)

PLUGIN_NAME = "exo-batching"
STAGE_REPORT_S = 1.0  # how often a stage tells the others what its steps take
STAGE_TIMING_FRESH_S = 10.0  # a stage's report older than this is not used


class BatchingPlugin:
  def __init__(self, node, config: BatchingConfig):
    self.node, self.config = node, config
    self.steps = StepLoop(node.inference_engine, self._new_scheduler, node.requests.is_live, self._step_done, finishing_for=self._finishing_for,
                          engine_for=node.model_pool.engine_of)
    self.sampling_stats = BatchStats()  # rows per sampling call
    self.mask_times = MaskTimes()  # grammar masks computed during steps
    self.stage_costs: Dict[Tuple[str, str], Tuple[StepCost, float]] = {}  # (node id, model) -> its stage's step cost, when heard
    self._reported: Dict[Shard, float] = {}  # when each of our stages last told the others its step cost
    node.inbox.observe(statuses.STAGE_TIMING, self._heard_stage_timing)

  # --- hooks ---

  @hookimpl
  def exo_infer_tensor(self, node, shard, tensor, request_id, inference_state, accepted):
    request = node.requests.get(request_id)
    return self.steps.infer(shard, request_id, tensor, inference_state, accepted, whole=request is not None and request.came_packed)

  @hookimpl
  def exo_request_ended(self, node, request_id):
    self.steps.forget(request_id)

  @hookimpl
  def exo_node_stopping(self, node):
    return self.stop()

  @hookimpl
  def exo_run_summary(self, node):
    if not self.sampling_stats.flushes and not self.step_stats().flushes:
      return None
    return f"mean batch size {self.sampling_stats.mean:.1f} (sampling), {self.step_stats().mean:.1f} (engine steps)"

  # --- forward passes ---

  @property
  def schedulers(self) -> Dict[Shard, Scheduler]:
    return self.steps.schedulers

  def _new_scheduler(self, shard: Shard) -> Scheduler:
    scheduler = Scheduler(shard, self.config.batch_size, self.config.timeout_ms / 1000, self.config.prefill_chunk)
    scheduler.stages = len(self.node.ring_ids(shard))
    return scheduler

  def _step_done(self, scheduler: Scheduler, step: Step, done: Done) -> None:
    """After each step: the ring's size is kept current, the stage's timing told to the others."""
    scheduler.stages = len(self.node.ring_ids(scheduler.shard))
    self._report(scheduler)
    if scheduler.shard.is_first_layer():
      scheduler.other_stages = self._other_stages(scheduler)

  # --- what the other stages take (for the number of micro-batches) ---

  def _report(self, scheduler: Scheduler) -> None:
    """Every STAGE_REPORT_S, tell the ring what this stage's decode steps take (a status old nodes ignore)."""
    now, cost = time.monotonic(), scheduler.times.cost()
    if cost is None or not self.node.peers or now - self._reported.get(scheduler.shard, -math.inf) < STAGE_REPORT_S:
      return
    self._reported[scheduler.shard] = now
    status = statuses.StageTiming.build(node_id=self.node.id, shard=scheduler.shard, fixed_s=cost.fixed_s, per_row_s=cost.per_row_s,
                                        busy=scheduler.times.busy_fraction(now))
    self.node.spawn(self.node.broadcast_opaque_status("", status))

  def _heard_stage_timing(self, request_id: str, status: statuses.StageTiming, sender_host: Optional[str]) -> None:
    if status.node_id != self.node.id:
      self.stage_costs[(status.node_id, status.shard.model_id)] = (StepCost(status.fixed_s, status.per_row_s), time.monotonic())

  def _other_stages(self, scheduler: Scheduler) -> List[StepCost]:
    """The other stages' step costs, heard within STAGE_TIMING_FRESH_S; [] unless every one of them is known."""
    now, model = time.monotonic(), scheduler.shard.model_id
    heard = [self.stage_costs.get((node_id, model)) for node_id in self.node.ring_ids(scheduler.shard) if node_id != self.node.id]
    if not heard or any(h is None or now - h[1] > STAGE_TIMING_FRESH_S for h in heard):
      return []
    return [cost for cost, _ in heard]

  def step_stats(self) -> BatchStats:
    stats = BatchStats()
    for scheduler in self.schedulers.values():
      stats.sizes.update(scheduler.stats.sizes)
    return stats

  # --- sampling, inside the step ---

  def _finishing_for(self, scheduler: Scheduler, step: Step):
    """What finishes the rows this step finishes, together, right after its forward pass: on the last layers their
    sampling (the masks of rows that follow a grammar computed meanwhile on the grammar threads, compiling a new
    request's grammar first, beside its prompt's pass), then the step core's one output for all of them."""
    shard, masks = scheduler.shard, None
    if shard.is_last_layer():
      finishing = [self.node.requests.get(row.request_id) for row, take in step.rows if take == row.length]
      finishing = [r for r in finishing if r is not None]
      masks = asyncio.ensure_future(self._masks(shard, finishing)) if any(r.params.grammar for r in finishing) else None

    async def finish(done: Done):
      sampled = await self._sample(shard, done, masks) if shard.is_last_layer() else {}
      rows = [(row.request_id, row.received, result[0], result[1]) for row, result in done if not isinstance(result, BaseException)]
      output = await self.node.step_core.finish_step(shard, rows, sampled)
      coming_back = [row[0] for hop in output.hops.values() if hop.to.node_id == self.node.id for row in hop.rows]

      def send() -> None:
        self.steps.expect(coming_back)
        self.node.forwarding.send(output)
      return send
    return finish

  async def _masks(self, shard: Shard, requests) -> Dict[str, np.ndarray]:
    prepared = await constrained.prepare(requests, self.node.model_pool.engine_of(shard).tokenizer)
    ready = [(r.id, c) for r, c in zip(requests, prepared) if isinstance(c, Constraint)]
    masks = await constrained.masks_of([c for _, c in ready], self.mask_times)
    return {request_id: mask for (request_id, _), mask in zip(ready, masks)}

  async def _sample(self, shard: Shard, done: Done, masks: Optional[asyncio.Future]) -> Dict[str, Union[int, Exception]]:
    """The token of each row the step finished, drawn together."""
    # A request that ended while its step ran (error, cancel, stop) must not be revived by its token.
    rows = [(row.request_id, result[0]) for row, result in done if not isinstance(result, BaseException) and self.node.requests.is_live(row.request_id)]
    try:
      ready = await masks if masks is not None else {}
    except Exception:  # whatever failed is met again, and reported per row, when the rows are sampled
      ready = {}
    if not rows:
      return {}
    request_ids = [request_id for request_id, _ in rows]
    tokens = await self._sample_rows(shard, [logits for _, logits in rows], request_ids, [ready.get(r) for r in request_ids])
    self.sampling_stats.record(len(rows))
    log.debug("[batching] sampled %d request(s) together on %s; sampling: %s", len(rows), shard.model_id, self.sampling_stats)
    return dict(zip(request_ids, tokens))

  async def _sample_rows(self, shard: Shard, results: List[np.ndarray], request_ids: List[str], masks: List[Optional[np.ndarray]]) -> List[Union[int, Exception]]:
    """One vectorised call for every row; if it fails, each row on its own so that a bad row fails alone."""
    states = [self.node.requests.get(request_id) for request_id in request_ids]
    saved = [state.sampled_here().generator.bit_generator.state for state in states]
    try:
      return list(await self.node.passes.sample_tokens(shard, results, request_ids, masks, self.mask_times))
    except Exception as e:
      if len(results) == 1:
        return [e]
      log.log(VERBOSE, "[batching] sampling %d rows together failed (%r); sampling each alone", len(results), e)
    tokens: List[Union[int, Exception]] = []
    for state, generator_state, result, request_id, mask in zip(states, saved, results, request_ids, masks):
      state.sampled_here().generator.bit_generator.state = generator_state  # the failed call must not move anyone's random stream
      try:
        tokens.append((await self.node.passes.sample_tokens(shard, [result], [request_id], [mask], self.mask_times))[0])
      except Exception as e:
        tokens.append(e)
    return tokens

  # --- lifecycle ---

  async def stop(self) -> None:
    """Steps under way finish; requests still waiting for a step end with an error."""
    await self.steps.stop()
    for _ in range(3):  # let the requests just failed reach their error handlers while the node still runs
      await asyncio.sleep(0)
    log.debug("[batching] stopped; sampling: %s; engine steps: %s", self.sampling_stats, self.step_stats())


def register_batching(node, config: BatchingConfig) -> BatchingPlugin:
  """Turn batching on for `node` (the CLI calls this when EXO_BATCH_SIZE / --batch-size is 2 or more)."""
  plugin = BatchingPlugin(node, config)
  node.plugins.register(plugin, name=PLUGIN_NAME)
  log.info("exo: %s", config.describe())
  return plugin

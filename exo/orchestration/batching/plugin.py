"""The batching plugin (`exo_scheduler`): each shard's steps take up to EXO_BATCH_SIZE rows, wait up to
EXO_BATCH_TIMEOUT_MS for others to join, cut prompts in chunks beside running streams, and keep micro-batches in flight
round the ring, sized from what the stages tell each other their steps take (`stage_timing`). Nodes without it, and
upstream nodes, share the ring unchanged."""
import logging
import math
import time
from typing import Dict, List, Optional, Tuple

from exo.inference.shard import Shard
from exo.orchestration import statuses
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.steps.micro_batches import StepCost
from exo.orchestration.steps.scheduler import BatchStats, Scheduler
from exo.orchestration.hookspecs import hookimpl

log = logging.getLogger(__name__)

PLUGIN_NAME = "exo-batching"
STAGE_REPORT_S = 1.0  # how often a stage tells the others what its steps take
STAGE_TIMING_FRESH_S = 10.0  # a stage's report older than this is not used


class BatchingPlugin:
  def __init__(self, node, config: BatchingConfig):
    self.node, self.config = node, config
    self.stage_costs: Dict[Tuple[str, str], Tuple[StepCost, float]] = {}  # (node id, model) -> its stage's step cost, when heard
    self._reported: Dict[Shard, float] = {}  # when each of our stages last told the others its step cost
    node.inbox.observe(statuses.STAGE_TIMING, self._heard_stage_timing)

  @hookimpl
  def exo_scheduler(self, node, shard):
    return Scheduler(shard, self.config.batch_size, self.config.timeout_ms / 1000, self.config.prefill_chunk, stages=len(node.ring_ids(shard)))

  @hookimpl
  def exo_step_done(self, node, scheduler, step):
    """After each step: the ring's size is kept current, the stage's timing told to the others."""
    scheduler.stages = len(self.node.ring_ids(scheduler.shard))
    self._report(scheduler)
    if scheduler.shard.is_first_layer():
      scheduler.other_stages = self._other_stages(scheduler)

  @hookimpl
  def exo_node_stopping(self, node):
    log.debug("[batching] stopped; sampling: %s; engine steps: %s", node.step_core.sampling_stats, self.step_stats())

  @hookimpl
  def exo_run_summary(self, node):
    sampling, steps = node.step_core.sampling_stats, self.step_stats()
    if not sampling.flushes and not steps.flushes:
      return None
    return f"mean batch size {sampling.mean:.1f} (sampling), {steps.mean:.1f} (engine steps)"

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
    for scheduler in self.node.steps.schedulers.values():
      stats.sizes.update(scheduler.stats.sizes)
    return stats


def register_batching(node, config: BatchingConfig) -> BatchingPlugin:
  """Turn batching on for `node` (the CLI calls this when EXO_BATCH_SIZE / --batch-size is 2 or more)."""
  plugin = BatchingPlugin(node, config)
  node.plugins.register(plugin, name=PLUGIN_NAME)
  log.info("exo: %s", config.describe())
  return plugin

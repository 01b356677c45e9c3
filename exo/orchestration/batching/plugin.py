"""The batching plugin: the hook implementations that let concurrent requests share work on this node.

Sampling on the last layer: every request whose logits are ready is sampled in one vectorised call
(`node.sample_tokens`, each row with its own parameters and random stream), then each token goes through
`node.handle_token` exactly as it would unbatched. Every request still travels the ring as its own message."""
import sys
from collections import defaultdict
from typing import Dict, List, Optional, Set, Tuple, Union

import numpy as np

from exo.helpers import DEBUG
from exo.inference.sampling import make_generator
from exo.inference.shard import Shard
from exo.orchestration.batching.batcher import Batcher
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.hookspecs import hookimpl

PLUGIN_NAME = "exo-batching"

SampleItem = Tuple[np.ndarray, str, Optional[dict], bool]  # logits, request id, inference state, was outstanding


class BatchingPlugin:
  def __init__(self, node, config: BatchingConfig):
    self.node, self.config = node, config
    self.sampler: Batcher[Shard, SampleItem, None] = Batcher(self._sample_group, config.batch_size, config.timeout_ms / 1000, self._nothing_else_coming)
    # Requests in a forward pass of a last shard: each is sampled next, so a sampling batch waits for them.
    self.forwarding: Dict[Shard, Set[str]] = defaultdict(set)

  # --- hooks ---

  @hookimpl(wrapper=True)
  def exo_infer_tensor(self, node, shard, tensor, request_id, inference_state):
    step = yield
    return self._tracked_forward(shard, request_id, step) if shard.is_last_layer() and step is not None else step

  @hookimpl
  def exo_process_inference_result(self, node, shard, result, request_id, inference_state):
    if not shard.is_last_layer():
      return None  # hidden states go on to the next node as they are
    return self._sample(shard, result, request_id, inference_state)

  @hookimpl
  def exo_node_stopping(self, node):
    return self.stop()

  @hookimpl
  def exo_run_summary(self, node):
    return f"mean batch size {self.sampler.stats.mean:.1f}" if self.sampler.stats.flushes else None

  # --- sampling ---

  async def _tracked_forward(self, shard: Shard, request_id: str, step):
    self.forwarding[shard].add(request_id)
    try:
      return await step
    except BaseException:
      self._left(shard, request_id)  # it will not be sampled: stop waiting for it
      raise

  def _left(self, shard: Shard, request_id: str) -> None:
    self.forwarding[shard].discard(request_id)
    self.sampler.poke(shard)

  async def _sample(self, shard: Shard, result: np.ndarray, request_id: str, inference_state: Optional[dict]) -> None:
    self.forwarding[shard].discard(request_id)
    await self.sampler.submit(shard, (result, request_id, inference_state, request_id in self.node.outstanding_requests))

  def _nothing_else_coming(self, shard: Shard, waiting: int) -> bool:
    coming = self.forwarding.get(shard)
    if coming:
      coming.intersection_update(self.node.outstanding_requests)  # forget requests that ended meanwhile
    return not coming

  async def _sample_group(self, shard: Shard, items: List[SampleItem]) -> List[Optional[BaseException]]:
    node = self.node
    # A request ended elsewhere while it waited (error, cancel, stop) must not be revived by its token.
    live = [item for item in items if not item[3] or item[1] in node.outstanding_requests]
    tokens = dict(zip((item[1] for item in live), await self._sample_rows(shard, [item[0] for item in live], [item[1] for item in live])))
    outcomes: List[Optional[BaseException]] = []
    for _, request_id, state, _ in items:
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
    states = [self.node.request_state(request_id) for request_id in request_ids]
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
    await self.sampler.stop()
    if DEBUG >= 2:
      print(f"[batching] stopped; sampling: {self.sampler.stats}")


def register_batching(node, config: BatchingConfig) -> BatchingPlugin:
  """Turn batching on for `node` (the CLI calls this when EXO_BATCH_SIZE / --batch-size is 2 or more)."""
  plugin = BatchingPlugin(node, config)
  node.plugins.register(plugin, name=PLUGIN_NAME)
  print(f"exo: {config.describe()}", file=sys.stderr, flush=True)
  return plugin

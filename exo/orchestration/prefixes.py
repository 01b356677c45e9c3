"""The prompt-prefix protocol between the nodes of a request's route (the engines' stores: inference/prefix_cache.py).

When every node of a route reuses prefixes (a prefix_cache status says so; upstream nodes never do), the first node
starts the request from the longest prefix its engine holds; the keys and positions reused travel in the inference
state (`"prefix"`), and each node files the request's KV under those keys. A node that lacks the prefix says so
(prefix_miss) and the prompt runs again, whole. A finished request's keys, the answer's included, go to every node
first (prefix_extend) and are filed at the first node last: later requests only name blocks every node was told of."""
import asyncio
import logging
from typing import Optional, Set

import numpy as np

from exo.inference.prefix_cache import BLOCK, block_keys, checked_prefix
from exo.inference.shard import Shard
from exo.orchestration import statuses
from exo.orchestration.requests import Request, RequestEnded

log = logging.getLogger(__name__)

FILING_TIMEOUT_S = 2.0  # the longest a finished answer's blocks wait for a peer (a new prompt waits for them)


class PrefixProtocol:
  def __init__(self, node):
    self.node = node
    self.engine = node.inference_engine  # the node's own (whether it reuses prefixes says for every engine of its class)
    self.filings: Set[asyncio.Task] = set()  # finished answers being filed (see _file_answer)
    node.inbox.on_peer(statuses.PREFIX_MISS, self._heard_miss)
    node.inbox.on_peer(statuses.PREFIX_EXTEND, self._heard_extend)

  async def announce(self) -> None:
    """Tell the ring whether this node reuses prompt prefixes (block 0: it does not). Upstream nodes never say."""
    block = BLOCK if self.engine.reuses_prefixes else 0
    await self.node.broadcast_opaque_status("", statuses.PrefixCache.build(node_id=self.node.id, block=block))

  async def run_prompt(self, shard: Shard, tokens: np.ndarray, request: Request, state: dict, accepted: Optional[asyncio.Future]) -> None:
    """A prompt's pass from its first layers: from a cached prefix when every node of its route reuses them."""
    state = {k: v for k, v in state.items() if k != "prefix"}  # only this node may name one
    if self.engine.reuses_prefixes and all(self.node.peer_prefix_blocks.get(n) == BLOCK for n in request.ring if n != self.node.id):
      await self._run_from_prefix(shard, tokens, request, state, accepted=accepted)
    else:
      await self.node.steps.infer(shard, request.id, tokens, state, accepted)

  async def _run_from_prefix(self, shard: Shard, tokens: np.ndarray, request: Request, state: dict, reuse: bool = True,
                             accepted: Optional[asyncio.Future] = None) -> None:
    """The prompt from the longest prefix the engine holds (none if not `reuse`), the rest of the route told which one."""
    keys = block_keys(shard.model_id, tokens)
    if self.filings:  # an answer that just finished may be what this prompt starts with: a few ms
      await asyncio.wait(list(self.filings))
    reused = await self.node.model_pool.engine_of(shard).start_from_prefix(request.id, shard, keys if reuse else [], tokens.shape[1] - 1)
    request.positions = reused
    request.first_stage.rerun = (shard, tokens) if reused else None  # kept while another node may lack the prefix
    request.first_stage.sequence = tokens[0].tolist()
    await self.node.steps.infer(shard, request.id, tokens[:, reused:], {**state, "prefix": {"keys": keys, "reuse": reused}}, accepted)

  def fed_back(self, request: Request, tensor: np.ndarray) -> None:
    """A token came back to the first node: its cache holds it too."""
    if request.first_stage is not None and request.first_stage.sequence is not None:
      request.first_stage.sequence += np.asarray(tensor).reshape(-1).tolist()

  def finished(self, request: Request) -> None:
    if request.first_stage is not None and request.first_stage.sequence is not None:
      filing = self.node.spawn(self._file_answer(request))
      self.filings.add(filing)
      filing.add_done_callback(self.filings.discard)

  async def _file_answer(self, request: Request) -> None:
    """Every node files the finished request's blocks, the answer's included; the others first."""
    keys = block_keys(request.model, np.array(request.first_stage.sequence, dtype=np.int64))
    if len(keys) * BLOCK <= request.first_stage.prompt_tokens:  # the answer completed no block past the prompt's
      return
    status, peers = statuses.PrefixExtend.build(request_id=request.id, keys=keys), [p for p in self.node.peers if p.id() in request.ring]
    # A peer the status misses answers a later request with prefix_miss, which stays correct.
    await asyncio.gather(*[asyncio.wait_for(p.send_opaque_status(request.id, status), FILING_TIMEOUT_S) for p in peers], return_exceptions=True)
    (request.engine or self.engine).extend_prefix(request.id, keys)

  def _heard_miss(self, request_id: str, status: statuses.PrefixMiss, sender_host: Optional[str]) -> None:
    request = self.node.requests.get(status.request_id)
    if request is not None and request.first_stage is not None and request.first_stage.rerun is not None and (sender_host is None or self.node.on_path(request, sender_host)):
      self.node.spawn(self._prefill_again(request))

  async def _prefill_again(self, request: Request) -> None:
    """A node lacked the prefix the request reused: its whole prompt runs again, on every node, from position 0."""
    (shard, tokens), request.first_stage.rerun = request.first_stage.rerun, None
    try:
      await self._run_from_prefix(shard, tokens, request, {}, reuse=False)
    except RequestEnded:
      pass
    except Exception as e:
      await self.node.lifecycle.fail_request(request.id, e)

  async def start_here(self, shard: Shard, request: Request, state: Optional[dict]) -> bool:
    """A pass that names a prefix, after the first node: the cache starts with it; False (first node told) if not held."""
    prefix = (state or {}).get("prefix")
    if prefix is None:
      return True
    prefix = checked_prefix(prefix)
    reuse = prefix["reuse"]
    held = await self.node.model_pool.engine_of(shard).start_from_prefix(request.id, shard, prefix["keys"], reuse) if self.engine.reuses_prefixes else 0
    if held != reuse:
      log.warning("exo: request %s was sent to reuse %d cached positions that this node does not hold; its prompt runs again, whole", request.id, reuse)
      self.node.spawn(self.node.forwarding.tell(request, request.id, statuses.PrefixMiss.build(request_id=request.id, node_id=self.node.id)))
      return False
    request.positions = reuse
    return True

  def ran(self, shard: Shard, request: Request, state: Optional[dict]) -> Optional[dict]:
    """After a pass: a prompt that named its prefix is filed under its keys; past the last layers it goes no further."""
    prefix = (state or {}).get("prefix")
    if prefix is None:
      return state
    self.node.model_pool.engine_of(shard).remember_prefix(request.id, prefix["keys"])
    return {k: v for k, v in state.items() if k != "prefix"} if shard.is_last_layer() else state

  def _heard_extend(self, request_id: str, status: statuses.PrefixExtend, sender_host: Optional[str]) -> None:
    if sender_host is None or self.node.peers_at(sender_host):
      for engine in self.node.model_pool.all_engines():  # (the request has ended here: the engine that holds its entry files it, the others ignore it)
        engine.extend_prefix(status.request_id, status.keys)

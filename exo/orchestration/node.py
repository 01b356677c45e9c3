"""Node: one member of the cluster, a thin shell over its parts (placements, routing/, prefixes, membership,
lifecycle, passes, steps/): the node's own lifecycle, the public API upstream's callers use, and the plugin manager
whose hooks pick the steps' policy and wrap each row's result."""
import asyncio
import logging
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import pluggy

from exo.download.download_progress import RepoProgressEvent
from exo.helpers import AsyncCallbackSystem
from exo.inference.inference_engine import InferenceEngine, inference_engine_classes
from exo.inference import grammar
from exo.inference.shard import Shard
from exo.logs import VERBOSE
from exo.orchestration import hookspecs, statuses
from exo.orchestration.steps.scheduler import LONE_PROMPT_CHUNK, Scheduler
from exo.orchestration.steps.loop import StepLoop
from exo.orchestration.hookspecs import hookimpl
from exo.orchestration.lifecycle import Lifecycle
from exo.orchestration.membership import Membership
from exo.orchestration.model_gate import ModelGate
from exo.orchestration.model_pool import ModelPool
from exo.orchestration.passes import Passes
from exo.orchestration.placements import Placements
from exo.orchestration.prefixes import PrefixProtocol
from exo.orchestration.requests import Request, RequestEvent, RequestRegistry, Status
from exo.orchestration.ring_member import RingMember
from exo.orchestration.steps.core import StepCore
from exo.orchestration.routing.forwarding import Forwarding
from exo.topology.device_capabilities import device_capabilities
from exo.topology.partitioning_strategy import PartitioningStrategy
from exo.topology.placement import Stage


log = logging.getLogger(__name__)


class CorePlugin:
  """The node's own behaviour, as the last implementation of each hook."""

  @hookimpl(trylast=True)
  def exo_scheduler(self, node, shard):
    return Scheduler(shard, 1, 0.0, LONE_PROMPT_CHUNK)  # one row a step, no wait, a long prompt in pieces

  @hookimpl(trylast=True)
  def exo_process_inference_result(self, node, shard, result, request_id, inference_state):
    return node.step_core.add(shard, result, request_id, inference_state)


class Node(RingMember):
  def __init__(self, _id: str, server, inference_engine: InferenceEngine, discovery, shard_downloader,
               partitioning_strategy: Optional[PartitioningStrategy] = None, max_generate_tokens: int = 1024,
               default_sample_temperature: float = 0.0, topology_viz=None):
    super().__init__(_id, discovery, partitioning_strategy, topology_viz)
    self.inference_engine = inference_engine
    self.server = server
    self.shard_downloader = shard_downloader
    self.max_generate_tokens = max_generate_tokens
    self.default_sample_temperature = default_sample_temperature
    self.node_download_progress: Dict[str, RepoProgressEvent] = {}
    self.node_download_sources: Dict[str, Dict[str, str]] = {}  # node id -> its files arriving now -> "hub" or "peer <id>"
    self.memory_offered_mb: Optional[int] = None  # what this node offers the cluster instead of the machine's memory
    self.requests = RequestRegistry()
    self.model_pool = ModelPool(inference_engine, shard_downloader, lambda: self.placements.own_facts())  # the chat models loaded here, one engine each
    self.model_gate = ModelGate(room=self.model_pool)
    self._on_token = AsyncCallbackSystem[str, Tuple[str, List[int], bool]]()
    self._tasks: Set[asyncio.Task] = set()
    self._background: List[asyncio.Task] = []
    self.placements = Placements(self)
    self.forwarding = Forwarding(self)
    self.lifecycle = Lifecycle(self)
    self.step_core = StepCore(self)
    self.steps = StepLoop(inference_engine, lambda shard: self.plugins.hook.exo_scheduler(node=self, shard=shard), self.requests.is_live,
                          lambda scheduler, step: self.plugins.hook.exo_step_done(node=self, scheduler=scheduler, step=step),
                          finishing_for=self.step_core.finishing_for, engine_for=self.model_pool.engine_of)
    self.passes = Passes(self)
    self.prefix_protocol = PrefixProtocol(self)
    self.membership = Membership(self)
    self.plugins = pluggy.PluginManager("exo")
    self.plugins.add_hookspecs(hookspecs)
    self.plugins.register(CorePlugin(), name="exo-core")  # installed plugins: exo.main.load_installed_plugins

  async def start(self, wait_for_peers: int = 0) -> None:
    self.device_capabilities = await device_capabilities(self.inference_engine.device_name)
    if self.memory_offered_mb is not None:
      self.device_capabilities = self.device_capabilities.model_copy(update={"memory": self.memory_offered_mb})
    if self.server is not None:
      await self.server.start()
    await self.discovery.start()
    await self.update_peers(wait_for_peers)
    await self.collect_topology(set())
    log.debug("Collected topology: %s", self.topology)
    await self.announce()
    self._background = [asyncio.create_task(self.periodic_topology_collection(2.0)), asyncio.create_task(self.membership.watch_peers())]
    if self.placements.mode is not None:
      self._background.append(asyncio.create_task(self.forwarding.report_loads_periodically()))
    self.plugins.hook.exo_node_started(node=self)

  async def stop(self) -> None:
    await asyncio.gather(*[a for a in self.plugins.hook.exo_node_stopping(node=self) if a is not None])
    tasks = list(self._tasks) + self._background
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for request in self.requests:
      self.lifecycle.end_request(request.id, Status.FAILED, "node stopped")
    await self.steps.stop()  # (the step under way finishes; nothing waits for another)
    await asyncio.gather(*list(self.lifecycle.releases), return_exceptions=True)
    self.model_pool.close()
    await self.discovery.stop()
    if self.server is not None:
      await self.server.stop()

  def pending(self) -> Dict[str, int]:
    """Work under way here that no caller awaits: detached tasks, KV caches being freed, answers being filed, watchers."""
    return {"tasks": len(self._tasks), "releases": len(self.lifecycle.releases), "filings": len(self.prefix_protocol.filings),
            "watchers": len(self.lifecycle.watchers)}

  def spawn(self, coro) -> asyncio.Task:
    """A detached task the node keeps track of, so stop() can end it."""
    task = asyncio.create_task(coro)
    self._tasks.add(task)
    task.add_done_callback(self._tasks.discard)
    return task

  @property
  def outstanding_requests(self) -> Dict[str, str]:
    """Live requests here -> their status."""
    return {r.id: r.status.value for r in self.requests}

  @property
  def buffered_token_output(self) -> Dict[str, Tuple[List[int], bool]]:
    """Tokens sampled here for each live request (on the node with the last layers)."""
    return {r.id: (r.sampling.tokens, False) for r in self.requests if r.sampling and r.sampling.tokens}

  def state(self) -> dict:
    """The live view (GET /v1/state): the live requests here and their KV memory, the chat models loaded."""
    engines = self.model_pool.all_engines()
    return {"node_id": self.id,
            "requests": [{"id": r.id, "model": r.model, "status": r.status.value, "positions": r.positions,
                          "kv_bytes": (r.engine or self.inference_engine).request_kv_bytes(r.id), "group": r.group} for r in self.requests],
            "kv_bytes": sum(engine.kv_cache_bytes() for engine in engines),
            "prefix_cache": self.inference_engine.prefix_cache_state(),
            "models": self.model_pool.describe(), "model_loads": self.model_pool.loads}

  async def process_prompt(self, base_shard: Shard, prompt: str, request_id: Optional[str] = None, inference_state: Optional[dict] = {},
                           accepted: Optional[asyncio.Future] = None) -> Optional[np.ndarray]:
    """Run a prompt from its first layers here (or pass it on); `accepted` is resolved once its pass has started."""
    return await self.passes.process_prompt(base_shard, prompt, request_id, inference_state, accepted)

  async def process_tensor(self, base_shard: Shard, tensor: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None,
                           accepted: Optional[asyncio.Future] = None) -> Optional[np.ndarray]:
    """Run this node's layers for a message's tensor (one request's, or a packed step's rows, as one batch)."""
    return await self.passes.process_tensor(base_shard, tensor, request_id, inference_state, accepted)

  async def process_inference_result(self, shard, result: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None):
    return await self.plugins.hook.exo_process_inference_result(node=self, shard=shard, result=result, request_id=request_id, inference_state=inference_state)

  async def forward_prompt(self, base_shard: Shard, prompt: str, request_id: str, target_index: int, inference_state: Optional[dict] = None) -> None:
    """Upstream's API, by partition index (requests follow their routes through self.forwarding)."""
    await self.forwarding.send_prompt(*self._partition_stage(base_shard, target_index), prompt, request_id, inference_state)

  async def forward_tensor(self, base_shard: Shard, tensor: np.ndarray, request_id: str, target_index: int, inference_state: Optional[dict] = None) -> None:
    await self.forwarding.send_tensor(*self._partition_stage(base_shard, target_index), tensor, request_id, inference_state)

  def _partition_stage(self, base_shard: Shard, index: int) -> Tuple[Stage, Shard]:
    shard = self.get_current_shard(base_shard, index)
    return Stage(self.partitions()[index].node_id, shard.start_layer, shard.end_layer), shard

  def own_shard(self, base_shard: Shard) -> Shard:
    """This node's layers of a model: its placement's where routes are on, else its partition's."""
    return self.placements.own_shard(base_shard) or self.get_current_shard(base_shard)

  def ring_ids(self, shard: Optional[Shard] = None) -> Tuple[str, ...]:
    """The node ids of the ring (or, given one of this node's shards, of the group that holds it), first layers first."""
    placement = self.placements.placement(shard) if shard is not None else None
    group = placement.group_of(self.id) if placement is not None else None
    if group is not None:
      return group.node_ids
    return tuple(p.node_id for p in self.partitions()) if self.partitioning_strategy else (self.id,)

  def on_path(self, request: Request, host: str, origin_only: bool = False) -> bool:
    """Whether a call from `host` comes from the request's origin (or, unless origin_only, a node it runs on)."""
    senders = self.peers_at(host)
    allowed = {request.origin} if origin_only and request.origin else {request.origin, *request.ring}
    return bool(senders & allowed) or not (request.origin or request.ring)

  async def update_peers(self, wait_for_peers: int = 0) -> bool:
    changed, added, removed, moved = await self._update_peers(wait_for_peers)
    if changed:
      self.membership.peers_changed(added, removed, moved)
    return changed

  async def periodic_topology_collection(self, interval: float) -> None:
    while True:
      await asyncio.sleep(interval)
      try:
        if await self.update_peers():
          await self.broadcast_supported_engines(self.get_supported_inference_engines())
        # Every round: a peer may have dropped what this node announced before it knew this node.
        await self.announce()
        await self.collect_topology(set())
        self.lifecycle.forget_stale()
        self.placements.settle()
      except Exception as e:
        log.log(VERBOSE, "Error collecting topology: %r", e)

  async def announce(self) -> None:
    """Tell the ring what this node does beyond upstream's: prefix reuse, grammars, placement facts."""
    await self.prefix_protocol.announce()
    if grammar.available():
      await self.broadcast_opaque_status("", statuses.StructuredOutput.build(node_id=self.id, engine=grammar.ENGINE))
    await self.placements.announce()

  async def collect_topology(self, visited: Set[str], max_depth: int = 4):
    topology = await super().collect_topology(visited, max_depth)
    if self.topology_viz:
      self.topology_viz.update_visualization(self.topology, self.partitions(), self.id, self.node_download_progress, self.placements.to_json())
    return topology

  def get_supported_inference_engines(self) -> List[str]:
    name = self.inference_engine.__class__.__name__
    return [short for short, cls in inference_engine_classes.items() if cls == name and short != "dummy"]

  async def broadcast_supported_engines(self, supported_engines_names: List[str]) -> None:
    if supported_engines_names:
      await self.broadcast_opaque_status("", statuses.SupportedEngines.build(node_id=self.id, engines=supported_engines_names))

  def get_topology_inference_engines(self) -> List[List[str]]:
    return list(self.peer_engines.values())

  @property
  def on_token(self) -> AsyncCallbackSystem[str, Tuple[str, List[int], bool]]:
    return self._on_token

  def trigger_on_token_callbacks(self, request_id: str, tokens: List[int], is_finished: bool, logprobs: Optional[list] = None) -> None:
    """New tokens of a request, to its local client (Lifecycle.watch), the router and the on_token callbacks."""
    watcher = self.lifecycle.watchers.get(request_id)
    if watcher is not None:
      watcher.put_nowait(RequestEvent(list(tokens), is_finished, None, logprobs))
    self.forwarding.router.tokens(request_id, tokens, is_finished)
    self._on_token.trigger_all(request_id, tokens, is_finished)

  def accepts_prompt(self, request_id: str) -> None:
    """Before a peer's SendPrompt (the gRPC server asks): ValueError if the prompt must not start (Lifecycle.accepts_prompt)."""
    self.lifecycle.accepts_prompt(request_id)

  def on_result(self, request_id: str, result: List[int], is_finished: bool, sender_host: Optional[str] = None) -> None:
    """A peer's SendResult (or a token that reached this node otherwise)."""
    self.lifecycle.on_result(request_id, result, is_finished, sender_host)

  def receive_status(self, request_id: str, raw: str, sender_host: Optional[str] = None) -> None:
    """A peer's SendOpaqueStatus: checked once, acted on by its kind's handlers, then passed to the observers."""
    if self.inbox.from_peer(request_id, raw, sender_host):
      self._on_opaque_status.trigger_all(request_id, raw)

  def on_node_status(self, request_id: str, opaque_status: str) -> None:
    """The built-in status observer (who is working, download progress, the peers' engines), for a raw status."""
    self.inbox.from_self(request_id, opaque_status, quiet=True)

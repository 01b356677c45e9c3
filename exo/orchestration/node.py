"""Node: one member of the ring. It runs its shard's layers for every request, samples on the last layer, and
forwards each request round the ring as its own message (so it interoperates with upstream exo nodes)."""
import asyncio
import json
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import pluggy

from exo.download.download_progress import RepoProgressEvent
from exo.helpers import DEBUG, AsyncCallbackSystem
from exo.inference.inference_engine import InferenceEngine, inference_engine_classes
from exo.inference.sampling import SamplingParams, make_generator
from exo.inference.shard import Shard
from exo.orchestration import hookspecs
from exo.orchestration.hookspecs import hookimpl
from exo.orchestration.forward_started import FORWARD_STARTED, announce
from exo.topology.device_capabilities import UNKNOWN_DEVICE_CAPABILITIES, DeviceCapabilities, device_capabilities
from exo.topology.partitioning_strategy import Partition, PartitioningStrategy, map_partitions_to_shards
from exo.topology.topology import Topology

# Opaque-status types this fork adds; upstream nodes ignore types they do not know.
REQUEST_PARAMS = "request_params"  # a request's sampling parameters and the node that asked, sent before its prompt
CANCEL_REQUEST = "cancel_request"  # the client has gone or has what it wanted: stop generating
REQUEST_ERROR = "request_error"  # a hop failed: the request ends with this error
STALE_REQUEST_S = 3600.0  # forget parameters of requests that never ran here after this long
ENDED_REQUESTS_KEPT = 10000  # ids of recently ended requests, so stragglers of them are dropped, not revived


@dataclass
class RequestState:
  """What this node knows of one request: its sampling parameters, random stream, origin and fate."""
  params: SamplingParams = field(default_factory=SamplingParams)
  origin: Optional[str] = None  # the node whose client asked for it (unknown for requests from upstream nodes)
  generator: Optional[np.random.Generator] = None
  cancelled: bool = False
  created: float = field(default_factory=time.monotonic)


class CorePlugin:
  """The node's own behaviour, as the last implementation of each hook."""

  @hookimpl(trylast=True)
  def exo_infer_tensor(self, node, shard, tensor, request_id, inference_state):
    announce(FORWARD_STARTED.get())  # the engine takes it up as soon as the returned coroutine runs
    return node.inference_engine.infer_tensor(request_id, shard, tensor, inference_state)

  @hookimpl(trylast=True)
  def exo_process_inference_result(self, node, shard, result, request_id, inference_state):
    return node.process_inference_result_unbatched(shard, result, request_id, inference_state)


class Node:
  def __init__(self, _id: str, server, inference_engine: InferenceEngine, discovery, shard_downloader,
               partitioning_strategy: Optional[PartitioningStrategy] = None, max_generate_tokens: int = 1024,
               default_sample_temperature: float = 0.0, topology_viz=None):
    self.id = _id
    self.inference_engine = inference_engine
    self.server = server
    self.discovery = discovery
    self.shard_downloader = shard_downloader
    self.partitioning_strategy = partitioning_strategy
    self.peers: List = []
    self.topology = Topology()
    self.device_capabilities: DeviceCapabilities = UNKNOWN_DEVICE_CAPABILITIES
    self.buffered_token_output: Dict[str, Tuple[List[int], bool]] = {}
    self.max_generate_tokens = max_generate_tokens
    self.default_sample_temperature = default_sample_temperature
    self.topology_viz = topology_viz
    self.node_download_progress: Dict[str, RepoProgressEvent] = {}
    self.outstanding_requests: Dict[str, str] = {}
    self.requests: Dict[str, RequestState] = {}
    self.ended_requests: Dict[str, None] = {}  # insertion-ordered; trimmed to ENDED_REQUESTS_KEPT
    self.topology_inference_engines_pool: List[List[str]] = []
    self._on_token = AsyncCallbackSystem[str, Tuple[str, List[int], bool]]()
    self._on_opaque_status = AsyncCallbackSystem[str, Tuple[str, str]]()
    self._on_opaque_status.register("node_status").on_next(self.on_node_status)
    self._tasks: Set[asyncio.Task] = set()
    self._releases: Set[asyncio.Task] = set()  # KV caches being freed: stop() waits for these, never cancels them
    self._periodic_task: Optional[asyncio.Task] = None
    self._partitions: Tuple[Optional[tuple], List[Partition]] = (None, [])  # (what they were computed from, partitions)
    self._shards: Dict[Tuple[str, int], List[Shard]] = {}  # (model id, layers) -> each partition's shard, for _partitions
    self.plugins = pluggy.PluginManager("exo")
    self.plugins.add_hookspecs(hookspecs)
    self.plugins.register(CorePlugin(), name="exo-core")
    self.plugins.load_setuptools_entrypoints("exo")

  # --- lifecycle ---

  async def start(self, wait_for_peers: int = 0) -> None:
    self.device_capabilities = await device_capabilities(getattr(self.inference_engine, "device_name", "CPU"))
    if self.server is not None:
      await self.server.start()
    await self.discovery.start()
    await self.update_peers(wait_for_peers)
    await self.collect_topology(set())
    if DEBUG >= 2:
      print(f"Collected topology: {self.topology}")
    self._periodic_task = asyncio.create_task(self.periodic_topology_collection(2.0))
    self.plugins.hook.exo_node_started(node=self)

  async def stop(self) -> None:
    await asyncio.gather(*[a for a in self.plugins.hook.exo_node_stopping(node=self) if a is not None])
    tasks = list(self._tasks) + ([self._periodic_task] if self._periodic_task else [])
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for request_id in list(self.outstanding_requests):
      self._end_request_locally(request_id)
      self._on_opaque_status.trigger_all(request_id, json.dumps({"type": REQUEST_ERROR, "request_id": request_id, "error": "node stopped"}))
    await asyncio.gather(*list(self._releases), return_exceptions=True)
    await self.discovery.stop()
    if self.server is not None:
      await self.server.stop()

  def spawn(self, coro) -> asyncio.Task:
    """A detached task the node keeps track of, so stop() can end it."""
    task = asyncio.create_task(coro)
    self._tasks.add(task)
    task.add_done_callback(self._tasks.discard)
    return task

  # --- requests ---

  def request_state(self, request_id: str) -> RequestState:
    if request_id not in self.requests:
      self.requests[request_id] = RequestState(SamplingParams(temperature=self.default_sample_temperature))
    return self.requests[request_id]

  async def start_request(self, request_id: str, params: SamplingParams) -> None:
    """Tell every node a request's sampling parameters before its prompt enters the ring."""
    await self.broadcast_opaque_status(request_id, json.dumps({"type": REQUEST_PARAMS, "request_id": request_id, "params": params.to_dict(), "origin": self.id}))

  async def cancel_request(self, request_id: str) -> None:
    """Ask the ring to stop generating for a request (its client left or has what it wanted)."""
    await self.broadcast_opaque_status(request_id, json.dumps({"type": CANCEL_REQUEST, "request_id": request_id}))

  async def fail_request(self, request_id: str, error: BaseException | str) -> None:
    """End a request with an error everywhere, so its client gets the error instead of waiting."""
    if DEBUG >= 1:
      print(f"Request {request_id} failed on {self.id}: {error!r}")
      if DEBUG >= 2 and isinstance(error, BaseException):
        traceback.print_exception(error)
    self._end_request_locally(request_id)
    await self.broadcast_opaque_status(request_id, json.dumps({"type": REQUEST_ERROR, "request_id": request_id, "error": str(error) or repr(error)}))

  def _end_request_locally(self, request_id: str) -> None:
    self.ended_requests[request_id] = None
    if len(self.ended_requests) > ENDED_REQUESTS_KEPT:
      del self.ended_requests[next(iter(self.ended_requests))]
    self.outstanding_requests.pop(request_id, None)
    self.buffered_token_output.pop(request_id, None)
    self.requests.pop(request_id, None)
    self.plugins.hook.exo_request_ended(node=self, request_id=request_id)
    release = asyncio.create_task(self.inference_engine.finish_request(request_id))
    self._releases.add(release)
    release.add_done_callback(self._releases.discard)

  async def process_prompt(self, base_shard: Shard, prompt: str, request_id: Optional[str] = None, inference_state: Optional[dict] = {}) -> Optional[np.ndarray]:
    shard = self.get_current_shard(base_shard)
    request_id = request_id or str(uuid.uuid4())
    status = {"type": "node_status", "node_id": self.id, "status": "start_process_prompt", "base_shard": base_shard.to_dict(),
              "shard": shard.to_dict(), "prompt": prompt, "request_id": request_id}
    self.spawn(self.broadcast_opaque_status(request_id, json.dumps(status)))
    start = time.perf_counter_ns()
    try:
      await self._process_prompt(base_shard, prompt, request_id, inference_state)
    finally:
      status.update(status="end_process_prompt", elapsed_time_ns=time.perf_counter_ns() - start)
      self.spawn(self.broadcast_opaque_status(request_id, json.dumps(status)))
    return None

  async def _process_prompt(self, base_shard: Shard, prompt: str, request_id: str, inference_state: Optional[dict]) -> None:
    shard = self.get_current_shard(base_shard)
    if not shard.is_first_layer():
      self.outstanding_requests[request_id] = "waiting"
      await self.forward_prompt(shard, prompt, request_id, 0, inference_state)
      return
    self.outstanding_requests[request_id] = "processing"
    try:
      tokens = await self.inference_engine.encode(shard, prompt)
      result, state = await self.infer_tensor(shard, np.asarray(tokens).reshape(1, -1), request_id, inference_state)
      await self.process_inference_result(shard, result, request_id, state)
    except asyncio.CancelledError:
      self._end_request_locally(request_id)  # the caller gave up mid-prompt (timeout, client gone): free its state and KV cache
      raise
    except Exception as e:
      await self.fail_request(request_id, e)
      raise

  async def process_tensor(self, base_shard: Shard, tensor: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None) -> Optional[np.ndarray]:
    shard = self.get_current_shard(base_shard)
    request_id = request_id or str(uuid.uuid4())
    if request_id in self.ended_requests:
      # A hop still in flight when the request ended here (e.g. failed because the ring changed): going on would
      # run it round the ring until max_generate_tokens with nobody listening.
      return None
    self.outstanding_requests[request_id] = "processing"
    try:
      result, state = await self.infer_tensor(shard, tensor, request_id, inference_state)
      if request_id in self.ended_requests:  # it ended while this hop ran: forward nothing
        return None
      await self.process_inference_result(shard, result, request_id, state)
    except Exception as e:
      await self.fail_request(request_id, e)
    return None

  async def infer_tensor(self, shard: Shard, tensor: np.ndarray, request_id: str, inference_state: Optional[dict]):
    return await self.plugins.hook.exo_infer_tensor(node=self, shard=shard, tensor=tensor, request_id=request_id, inference_state=inference_state)

  async def process_inference_result(self, shard, result: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None):
    return await self.plugins.hook.exo_process_inference_result(node=self, shard=shard, result=result, request_id=request_id, inference_state=inference_state)

  async def process_inference_result_unbatched(self, shard: Shard, result: np.ndarray, request_id: str, inference_state: Optional[dict]) -> None:
    if not shard.is_last_layer():
      self.forward_or_finish(shard, result, request_id, inference_state, is_finished=False)
      return
    token = (await self.sample_tokens(shard, [result], [request_id]))[0]
    self.handle_token(shard, token, request_id, inference_state)

  async def sample_tokens(self, shard: Shard, results: List[np.ndarray], request_ids: List[str]) -> List[int]:
    """Sample each request's next token from its logits, each with its own parameters and random stream."""
    states = [self.request_state(rid) for rid in request_ids]
    for state in states:
      if state.generator is None:
        state.generator = make_generator(state.params.seed)
    tokens = await self.inference_engine.sample_batch(results, [s.params for s in states], [s.generator for s in states])
    await self.inference_engine.ensure_shard(shard)
    return [int(t) for t in np.asarray(tokens).reshape(-1)]

  def handle_token(self, shard: Shard, token: int, request_id: str, inference_state: Optional[dict]) -> None:
    """After sampling on the last layer: record, check EOS / length / cancel, fire callbacks, broadcast, forward."""
    buffer, _ = self.buffered_token_output.setdefault(request_id, ([], False))
    buffer.append(token)
    state = self.request_state(request_id)
    limit = min(state.params.max_tokens or self.max_generate_tokens, self.max_generate_tokens)
    tokenizer = self.inference_engine.tokenizer
    eos_ids = getattr(tokenizer, "eos_token_ids", None) or {tokenizer.eos_token_id}
    is_finished = (token in eos_ids and not state.params.ignore_eos) or len(buffer) >= limit or state.cancelled
    if DEBUG >= 2:
      print(f"[{request_id}] token {token} ({len(buffer)}/{limit}) finished={is_finished}")
    # The ring waits for the token, the client can wait a moment: local callbacks (streaming to clients) run on the
    # next turn of the event loop, after the next hop's send has started.
    self.forward_or_finish(shard, np.array([[token]], dtype=np.int64), request_id, inference_state, is_finished)
    asyncio.get_running_loop().call_soon(self.trigger_on_token_callbacks, request_id, [token], is_finished)
    # Each token goes to the node whose client waits for it; the last one goes to every node, which ends the request
    # there. (Upstream sends every token to every peer; a request from an upstream node has no known origin.)
    to = None if is_finished or state.origin is None else state.origin
    if any(to is None or peer.id() == to for peer in self.peers):
      self.spawn(self.broadcast_result(request_id, [token], is_finished, to))

  def forward_or_finish(self, shard: Shard, forward: np.ndarray, request_id: str, inference_state: Optional[dict], is_finished: bool) -> None:
    if is_finished:
      self._end_request_locally(request_id)
      return
    self.outstanding_requests[request_id] = "waiting"
    self.spawn(self._forward_next(shard, forward, request_id, inference_state))

  async def _forward_next(self, shard: Shard, tensor: np.ndarray, request_id: str, inference_state: Optional[dict]) -> None:
    try:
      await self.forward_tensor(shard, tensor, request_id, self.get_partition_index(offset=1), inference_state)
    except Exception as e:
      await self.fail_request(request_id, f"could not forward to the next node: {e}")

  # --- ring ---

  def partitions(self) -> List[Partition]:
    if self.id not in self.topology.nodes:  # before the first topology collection: a ring of one
      self.topology.update_node(self.id, self.device_capabilities)
    # Every message asks several times; the answer changes only with the topology.
    key = (self.partitioning_strategy, self.topology, self.topology.version)
    if self._partitions[0] != key:
      self._partitions = (key, self.partitioning_strategy.partition(self.topology))
      self._shards.clear()
    return self._partitions[1]

  def get_partition_index(self, offset: int = 0) -> Optional[int]:
    if not self.partitioning_strategy:
      return None
    partitions = self.partitions()
    index = next((i for i, p in enumerate(partitions) if p.node_id == self.id), None)
    if index is None:
      raise ValueError(f"No current partition found for node: {self.id}")
    return (index + offset) % len(partitions)

  def get_current_shard(self, base_shard: Shard, index: Optional[int] = None) -> Shard:
    if self.partitioning_strategy is None:  # no ring: this node holds every layer
      return Shard(base_shard.model_id, 0, base_shard.n_layers - 1, base_shard.n_layers)
    if index is None:
      index = self.get_partition_index()
    partitions, model = self.partitions(), (base_shard.model_id, base_shard.n_layers)
    if model not in self._shards:
      self._shards[model] = map_partitions_to_shards(partitions, base_shard.n_layers, base_shard.model_id)
    return self._shards[model][index]

  def _target(self, target_index: int) -> Tuple[str, Optional[object]]:
    target_id = self.partitions()[target_index].node_id
    if target_id == self.id:
      return target_id, None
    peer = next((p for p in self.peers if p.id() == target_id), None)
    if peer is None:
      raise ValueError(f"Peer for {target_index} not found")
    return target_id, peer

  async def forward_prompt(self, base_shard: Shard, prompt: str, request_id: str, target_index: int, inference_state: Optional[dict] = None) -> None:
    target_id, peer = self._target(target_index)
    next_shard = self.get_current_shard(base_shard, target_index)
    if DEBUG >= 2:
      print(f"forward prompt to {target_id} ({next_shard}) for {request_id}")
    if peer is None:
      await self.process_prompt(next_shard, prompt, request_id, inference_state)
    else:
      await peer.send_prompt(next_shard, prompt, request_id=request_id, inference_state=inference_state)

  async def forward_tensor(self, base_shard: Shard, tensor: np.ndarray, request_id: str, target_index: int, inference_state: Optional[dict] = None) -> None:
    target_id, peer = self._target(target_index)
    next_shard = self.get_current_shard(base_shard, target_index)
    if DEBUG >= 5:
      print(f"forward tensor {tensor.shape} to {target_id} ({next_shard}) for {request_id}")
    if peer is None:
      await self.process_tensor(next_shard, tensor, request_id, inference_state)
    else:
      await peer.send_tensor(next_shard, tensor, request_id=request_id, inference_state=inference_state)

  # --- peers and topology ---

  async def update_peers(self, wait_for_peers: int = 0) -> bool:
    next_peers = await self.discovery.discover_peers(wait_for_peers)
    current = {p.id(): p for p in self.peers}
    following = {p.id(): p for p in next_peers}
    removed = [p for pid, p in current.items() if pid not in following]
    added = [p for pid, p in following.items() if pid not in current]
    moved = [p for pid, p in following.items() if pid in current and current[pid].addr() != p.addr()]

    async def disconnect(peer):
      try:
        await asyncio.wait_for(peer.disconnect(), 5)
      except Exception as e:
        if DEBUG >= 1:
          print(f"Failed to disconnect peer {peer.id()}: {e!r}")

    async def connect(peer):
      try:
        if not await peer.is_connected():
          await asyncio.wait_for(peer.connect(), 5)
        return True
      except Exception as e:
        if DEBUG >= 1:
          print(f"Failed to connect peers: {peer.id()}@{peer.addr()}: {e!r}")
        return False

    await asyncio.gather(*[disconnect(p) for p in removed + [current[p.id()] for p in moved]])
    await asyncio.gather(*[connect(p) for p in next_peers])
    self.peers = list(following.values())
    changed = bool(removed or added or moved)
    if changed and DEBUG >= 1:
      print(f"Peers changed: added {[p.id() for p in added]}, removed {[p.id() for p in removed]}, moved {[p.id() for p in moved]}")
    if changed and self.outstanding_requests:
      # Layer ranges follow membership, so requests in flight lost their place in the ring (and KV caches):
      # end them with an error now rather than leave their clients waiting for tokens that will not come.
      why = f"the ring changed during the request (joined {[p.id() for p in added]}, left {[p.id() for p in removed]}, moved {[p.id() for p in moved]})"
      for request_id in list(self.outstanding_requests):
        self.spawn(self.fail_request(request_id, why))
    return changed

  async def periodic_topology_collection(self, interval: float) -> None:
    while True:
      await asyncio.sleep(interval)
      try:
        if await self.update_peers():
          await self.broadcast_supported_engines(self.get_supported_inference_engines())
        await self.collect_topology(set())
        self._forget_stale_requests()
      except Exception as e:
        if DEBUG >= 1:
          print(f"Error collecting topology: {e!r}")

  def _forget_stale_requests(self) -> None:
    now = time.monotonic()
    for request_id, state in list(self.requests.items()):
      if request_id not in self.outstanding_requests and now - state.created > STALE_REQUEST_S:
        del self.requests[request_id]

  async def collect_topology(self, visited: Set[str], max_depth: int = 4) -> Topology:
    next_topology = Topology()
    next_topology.update_node(self.id, self.device_capabilities)
    for peer in self.peers:
      next_topology.update_node(peer.id(), peer.device_capabilities())
      next_topology.add_edge(self.id, peer.id(), peer.description())
    prev_visited = set(visited)
    visited = visited | {self.id} | {p.id() for p in self.peers}

    async def collect(peer):
      if peer.id() in prev_visited or max_depth <= 0:
        return
      try:
        other = await asyncio.wait_for(peer.collect_topology(visited, max_depth - 1), 5)
        next_topology.merge(peer.id(), other)
      except Exception as e:
        if DEBUG >= 1:
          print(f"Error collecting topology from {peer.id()}: {e!r}")

    await asyncio.gather(*[collect(p) for p in self.peers])
    # Partition over exactly self + direct peers, as upstream does (wire.md §10).
    direct = {self.id} | {p.id() for p in self.peers}
    next_topology.nodes = {nid: caps for nid, caps in next_topology.nodes.items() if nid in direct}
    next_topology.active_node_id = self.topology.active_node_id
    self.topology = next_topology
    if self.topology_viz:
      self.topology_viz.update_visualization(self.topology, self.partitions(), self.id, self.node_download_progress)
    return self.topology

  @property
  def current_topology(self) -> Topology:
    return self.topology

  def get_supported_inference_engines(self) -> List[str]:
    name = self.inference_engine.__class__.__name__
    return [short for short, cls in inference_engine_classes.items() if cls == name and short != "dummy"]

  async def broadcast_supported_engines(self, supported_engines_names: List[str]) -> None:
    if supported_engines_names:
      await self.broadcast_opaque_status("", json.dumps({"type": "supported_inference_engines", "node_id": self.id, "engines": supported_engines_names}))

  def get_topology_inference_engines(self) -> List[List[str]]:
    return self.topology_inference_engines_pool

  # --- callbacks and broadcasts ---

  @property
  def on_token(self) -> AsyncCallbackSystem[str, Tuple[str, List[int], bool]]:
    return self._on_token

  @property
  def on_opaque_status(self) -> AsyncCallbackSystem[str, Tuple[str, str]]:
    return self._on_opaque_status

  def trigger_on_token_callbacks(self, request_id: str, tokens: List[int], is_finished: bool) -> None:
    self._on_token.trigger_all(request_id, tokens, is_finished)

  def on_result(self, request_id: str, result: List[int], is_finished: bool) -> None:
    """A peer's SendResult. Ids this node never saw are only passed to the callbacks (no state kept)."""
    self.trigger_on_token_callbacks(request_id, result, is_finished)
    if is_finished and (request_id in self.requests or request_id in self.outstanding_requests):
      self._end_request_locally(request_id)

  async def broadcast_result(self, request_id: str, result: List[int], is_finished: bool, to: Optional[str] = None) -> None:
    """SendResult to every peer, or only to peer `to`."""
    async def send(peer):
      try:
        await asyncio.wait_for(peer.send_result(request_id, result, is_finished), 15.0)
      except Exception as e:
        if DEBUG >= 1:
          print(f"Error sending result to {peer.id()}: {e!r}")
    await asyncio.gather(*[send(p) for p in self.peers if to is None or p.id() == to])

  async def broadcast_opaque_status(self, request_id: str, status: str) -> None:
    async def send(peer):
      try:
        await asyncio.wait_for(peer.send_opaque_status(request_id, status), 15.0)
      except Exception as e:
        if DEBUG >= 1:
          print(f"Error sending opaque status to {peer.id()}: {e!r}")
    # Local observers first: a dead peer (up to a 10 s connect wait) must not delay, e.g., a request_error for our own client.
    self._on_opaque_status.trigger_all(request_id, status)
    await asyncio.gather(*[send(p) for p in self.peers])

  def on_node_status(self, request_id: str, opaque_status: str) -> None:
    try:
      status = json.loads(opaque_status)
    except ValueError:
      return
    if not isinstance(status, dict):
      return
    kind = status.get("type")
    try:
      if kind == "node_status":
        if status.get("status", "").startswith("start_"):
          self.topology.active_node_id = status.get("node_id")
          if status.get("status") == "start_process_prompt" and status.get("node_id") != self.id and self.partitioning_strategy:
            self.spawn(self._preload(Shard.from_dict(status["shard"])))
        elif status.get("status", "").startswith("end_") and status.get("node_id") == self.topology.active_node_id:
          self.topology.active_node_id = None
      elif kind == "download_progress":
        self.node_download_progress[status["node_id"]] = RepoProgressEvent.from_dict(status["progress"])
      elif kind == "supported_inference_engines":
        self.topology_inference_engines_pool.append(status["engines"])
      elif kind == REQUEST_PARAMS:
        state = self.request_state(status["request_id"])
        state.params, state.origin = SamplingParams.from_dict(status["params"]), status.get("origin")
      elif kind == CANCEL_REQUEST and status["request_id"] in self.requests:
        self.requests[status["request_id"]].cancelled = True
      elif kind == REQUEST_ERROR and status["request_id"] not in self.ended_requests:
        self._end_request_locally(status["request_id"])  # also when unseen here yet: a late hop must not start it
    except (KeyError, TypeError, ValueError) as e:
      if DEBUG >= 1:
        print(f"Ignoring malformed {kind} status: {e!r}")
    if self.topology_viz:
      self.topology_viz.update_status(status)

  async def _preload(self, shard: Shard) -> None:
    """Start loading our own layers as soon as any node starts a prompt for a model."""
    try:
      await self.inference_engine.ensure_shard(self.get_current_shard(shard))
    except Exception as e:
      if DEBUG >= 1:
        print(f"Preloading {shard.model_id} failed: {e!r}")

"""Node: one member of the ring. It runs its shard's layers for every request, samples on the last layer, and
forwards each request round the ring as its own message (so it interoperates with upstream exo nodes).

Each request has one record here (exo/orchestration/requests.py). Every way work reaches the node (a prompt, a
tensor, a result, a status, a step, a sampled token) checks it first, so a request that has ended never runs,
samples, allocates or comes back. A request ends once: finished on the node that samples its last token (the others
learn it from that token), cancelled by its origin (its client left), or failed anywhere; cancellations and failures
travel the ring as opaque statuses and every node drops the request before its next step and frees its KV cache.

Prompt prefixes (exo/inference/prefix_cache.py): when every node of a request's ring reuses them, its first node
names the prompt's token blocks, starts the request from the longest prefix its engine holds and runs only the rest;
the block keys and the positions reused travel in the request's inference state, so each node starts from the same
prefix, and each files the request's KV under those keys once its prompt has run there. A node that lacks the
prefix says so (a prefix_miss status) and the first node runs the prompt again, whole, on every node. When the
request finishes, the first node, which knows the answer's tokens too, sends every node the keys of all the blocks
its cache holds (a prefix_extend status), then files them itself: a later request only names blocks that every node
has been told of."""
import asyncio
import json
import time
import traceback
import uuid
from typing import Dict, List, Optional, Set, Tuple, Union

import numpy as np
import pluggy

from exo.download.download_progress import RepoProgressEvent
from exo.helpers import DEBUG, AsyncCallbackSystem
from exo.inference.inference_engine import InferenceEngine, inference_engine_classes
from exo.inference import constrained, grammar
from exo.inference.grammar import CannotConstrain, MaskTimes
from exo.inference.prefix_cache import BLOCK, block_keys, checked_prefix
from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.inference.tokenizers import eos_ids
from exo.local_checkpoints import model_card
from exo.orchestration import hookspecs, statuses
from exo.orchestration.acceptance import accept
from exo.orchestration.hookspecs import hookimpl
from exo.orchestration.model_gate import LeftTheLine, ModelGate
from exo.orchestration.requests import Request, RequestEnded, RequestEvent, RequestRegistry, Status
from exo.orchestration.ring_member import PEER_CALL_TIMEOUT_S, RingMember
from exo.topology.device_capabilities import device_capabilities
from exo.topology.partitioning_strategy import PartitioningStrategy

PROMPT_CHUNK = 512  # prompt positions one unbatched engine call takes, so an end lands between chunks
PEER_LOGPROBS_AHEAD = 64  # a token's logprobs may arrive at most this many tokens before the token itself
PEER_CHECK_S = 2.0  # how often the peers that live requests need are health-checked
FILING_TIMEOUT_S = 2.0  # the longest a finished answer's blocks wait for a peer (a new prompt waits for them)
# A peer that dies mid-request ends it within PEER_CHECK_S + the health check's 5 s timeout (at once if a send fails).


class CorePlugin:
  """The node's own behaviour, as the last implementation of each hook."""

  @hookimpl(trylast=True)
  def exo_infer_tensor(self, node, shard, tensor, request_id, inference_state, accepted):
    accept(accepted)  # the engine takes it up as soon as the returned coroutine runs
    return node.infer_unbatched(shard, tensor, request_id, inference_state)

  @hookimpl(trylast=True)
  def exo_process_inference_result(self, node, shard, result, request_id, inference_state):
    return node.process_inference_result_unbatched(shard, result, request_id, inference_state)


def input_length(tensor: np.ndarray) -> int:
  """Positions a request's input holds: (1, L) token ids or (1, L, d) hidden states."""
  shape = np.shape(tensor)
  return shape[1] if len(shape) >= 2 and shape[0] == 1 else 1


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
    self.peer_grammar_engines: Dict[str, str] = {}  # peer id -> the grammar engine it samples requests' grammars with
    self.requests = RequestRegistry()
    self.model_gate = ModelGate()
    self._watchers: Dict[str, asyncio.Queue] = {}  # request id -> its local client's events (see `watch`)
    self._on_token = AsyncCallbackSystem[str, Tuple[str, List[int], bool]]()
    self._on_opaque_status.register("node_status").on_next(self.on_node_status)
    self._tasks: Set[asyncio.Task] = set()
    self._releases: Set[asyncio.Task] = set()  # KV caches being freed: stop() waits for these, never cancels them
    self._filings: Set[asyncio.Task] = set()  # finished answers being filed (see _file_answer)
    self._background: List[asyncio.Task] = []
    self.plugins = pluggy.PluginManager("exo")
    self.plugins.add_hookspecs(hookspecs)
    self.plugins.register(CorePlugin(), name="exo-core")  # installed plugins: exo.main.load_installed_plugins

  # --- lifecycle ---

  async def start(self, wait_for_peers: int = 0) -> None:
    self.device_capabilities = await device_capabilities(self.inference_engine.device_name)
    if self.server is not None:
      await self.server.start()
    await self.discovery.start()
    await self.update_peers(wait_for_peers)
    await self.collect_topology(set())
    if DEBUG >= 2:
      print(f"Collected topology: {self.topology}")
    await self.announce_prefix_cache()
    await self.announce_structured_output()
    self._background = [asyncio.create_task(self.periodic_topology_collection(2.0)), asyncio.create_task(self._watch_peers())]
    self.plugins.hook.exo_node_started(node=self)

  async def stop(self) -> None:
    await asyncio.gather(*[a for a in self.plugins.hook.exo_node_stopping(node=self) if a is not None])
    tasks = list(self._tasks) + self._background
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for request in self.requests:
      self.end_request(request.id, Status.FAILED, "node stopped")
    await asyncio.gather(*list(self._releases), return_exceptions=True)
    await self.discovery.stop()
    if self.server is not None:
      await self.server.stop()

  def pending(self) -> Dict[str, int]:
    """Work under way here that no caller awaits (a read-only view): detached tasks (sends to peers, filings),
    KV caches being freed, finished answers being filed, and local clients watching a request."""
    return {"tasks": len(self._tasks), "releases": len(self._releases), "filings": len(self._filings),
            "watchers": len(self._watchers)}

  def spawn(self, coro) -> asyncio.Task:
    """A detached task the node keeps track of, so stop() can end it."""
    task = asyncio.create_task(coro)
    self._tasks.add(task)
    task.add_done_callback(self._tasks.discard)
    return task

  # --- the request registry, as upstream's attributes ---

  @property
  def outstanding_requests(self) -> Dict[str, str]:
    """Live requests here -> their status."""
    return {r.id: r.status.value for r in self.requests}

  @property
  def buffered_token_output(self) -> Dict[str, Tuple[List[int], bool]]:
    """Tokens sampled here for each live request (on the node with the last layers)."""
    return {r.id: (r.tokens, False) for r in self.requests if r.tokens}

  def state(self) -> dict:
    """The live view (GET /v1/state): each live request here and the KV memory it holds."""
    engine = self.inference_engine
    return {"node_id": self.id,
            "requests": [{"id": r.id, "model": r.model, "status": r.status.value, "positions": r.positions,
                          "kv_bytes": engine.request_kv_bytes(r.id)} for r in self.requests],
            "kv_bytes": engine.kv_cache_bytes(),
            "prefix_cache": engine.prefix_cache_state()}

  # --- how requests start and end ---

  def _open(self, request_id: str) -> Optional[Request]:
    return self.requests.open(request_id, SamplingParams(temperature=self.default_sample_temperature))

  def watch(self, request_id: str) -> asyncio.Queue:
    """Events of one request for its local client: RequestEvent(tokens, finished, error). Only this request's
    tokens wake it."""
    queue = self._watchers[request_id] = asyncio.Queue()
    return queue

  def unwatch(self, request_id: str) -> None:
    self._watchers.pop(request_id, None)

  async def start_request(self, request_id: str, params: SamplingParams) -> None:
    """Open the request here (its origin) and tell every node its sampling parameters before its prompt enters the
    ring."""
    request = self.requests.open(request_id, params, self.id)
    if request is None:
      raise ValueError(f"request {request_id} has already ended")
    request.params = params
    sampler = self.ring_ids()[-1]
    if params.grammar and sampler != self.id and sampler not in self.peer_grammar_engines:
      # Its grammar would be ignored there (an upstream node, or one before structured output): no unconstrained answer.
      raise CannotConstrain(f"node {sampler}, which samples this model's tokens, has not said that it can constrain output; "
                            "it may run an exo without structured output, so the request is not run")
    await self.broadcast_opaque_status(request_id, statuses.request_params(request_id, params, self.id))

  async def cancel_request(self, request_id: str) -> None:
    """Stop the request everywhere (its client left or has what it wanted)."""
    if self.end_request(request_id, Status.CANCELLED):
      await self.broadcast_opaque_status(request_id, statuses.cancel_request(request_id))

  async def fail_request(self, request_id: str, error: BaseException | str) -> None:
    """End a request with an error everywhere, so its client gets the error instead of waiting."""
    message = (str(error) or repr(error)) if isinstance(error, BaseException) else error
    if DEBUG >= 1:
      print(f"Request {request_id} failed on {self.id}: {message}")
      if DEBUG >= 2 and isinstance(error, BaseException):
        traceback.print_exception(error)
    if self.end_request(request_id, Status.FAILED, message):
      await self.broadcast_opaque_status(request_id, statuses.request_error(request_id, message))

  def end_request(self, request_id: str, status: Status, error: Optional[str] = None) -> bool:
    """End the request here, whatever it is doing: it leaves every queue, its KV cache is freed, its local client
    learns why. True if it was live here."""
    request = self.requests.end(request_id, status)
    if request is None:
      return False
    if request.model is not None:
      self._release(request_id)  # before the gate lets another model in: the engine loads it only once caches are gone
      if status is Status.FINISHED and request.sequence is not None:
        filing = self.spawn(self._file_answer(request))
        self._filings.add(filing)
        filing.add_done_callback(self._filings.discard)
    self.model_gate.leave(request_id)
    self.plugins.hook.exo_request_ended(node=self, request_id=request_id)
    watcher = self._watchers.get(request_id)
    if watcher is not None and status is not Status.FINISHED:
      watcher.put_nowait(RequestEvent([], True, error or f"the request was {status.value}"))
    return True

  def _release(self, request_id: str) -> None:
    release = asyncio.create_task(self.inference_engine.finish_request(request_id))
    self._releases.add(release)
    release.add_done_callback(self._releases.discard)

  def accepts_prompt(self, request_id: str) -> None:
    """Raise ValueError if a prompt for `request_id` must not start (it has ended, or already has one)."""
    ended = self.requests.ended(request_id)
    if ended is not None:
      raise ValueError(f"request {request_id} has already {ended.value}")
    request = self.requests.get(request_id)
    if request is not None and request.status is not Status.QUEUED:
      raise ValueError(f"request {request_id} already has its prompt ({request.status.value})")

  # --- the work ---

  async def process_prompt(self, base_shard: Shard, prompt: str, request_id: Optional[str] = None, inference_state: Optional[dict] = {},
                           accepted: Optional[asyncio.Future] = None) -> Optional[np.ndarray]:
    """Run a prompt from its first layers here (or pass it on to the node that has them). `accepted`, if given,
    is resolved once its forward pass here has started (see acceptance)."""
    shard = self.get_current_shard(base_shard)
    request_id = request_id or str(uuid.uuid4())
    self.accepts_prompt(request_id)
    request = self._open(request_id)
    status = {"type": "node_status", "node_id": self.id, "status": "start_process_prompt", "base_shard": base_shard.to_dict(),
              "shard": shard.to_dict(), "prompt": prompt, "request_id": request_id}
    self.spawn(self.broadcast_opaque_status(request_id, json.dumps(status)))
    start = time.perf_counter_ns()
    try:
      await self._process_prompt(shard, prompt, request, inference_state, accepted)
    finally:
      status.update(status="end_process_prompt", elapsed_time_ns=time.perf_counter_ns() - start)
      self.spawn(self.broadcast_opaque_status(request_id, json.dumps(status)))
    return None

  async def _process_prompt(self, shard: Shard, prompt: str, request: Request, inference_state: Optional[dict], accepted: Optional[asyncio.Future]) -> None:
    try:
      if not shard.is_first_layer():
        request.advance(Status.PREFILLING)
        request.ring = request.ring or self.ring_ids()
        accept(accepted)  # no pass here: it goes on
        await self.forward_prompt(shard, prompt, request.id, 0, inference_state)
        return
      await self._enter(request, shard)
      tokens = np.asarray(await self.inference_engine.encode(shard, prompt)).reshape(1, -1)
      request.prompt_tokens = tokens.shape[1]
      context = self._context_length()
      if context is not None and tokens.shape[1] >= context:
        raise ValueError(f"the prompt is {tokens.shape[1]:,} tokens; this model's context is {context:,}")
      state = {k: v for k, v in (inference_state or {}).items() if k != "prefix"}  # only this node may name one
      if self._ring_reuses_prefixes(request):
        await self._run_from_prefix(shard, tokens, request, state, accepted=accepted)
      else:
        await self._run(shard, tokens, request, state, accepted)
    except RequestEnded:
      pass
    except asyncio.CancelledError:  # the caller gave up mid-prompt (timeout, client gone)
      if self.end_request(request.id, Status.CANCELLED):
        self.spawn(self.broadcast_opaque_status(request.id, statuses.cancel_request(request.id)))
      raise
    except Exception as e:
      await self.fail_request(request.id, e)
      raise

  async def _run_from_prefix(self, shard: Shard, tokens: np.ndarray, request: Request, inference_state: Optional[dict], reuse: bool = True,
                             accepted: Optional[asyncio.Future] = None) -> None:
    """On the first node: the prompt from the longest prefix the engine holds (none if not `reuse`), the rest of
    the ring told which one."""
    keys = block_keys(shard.model_id, tokens)
    if self._filings:  # an answer that just finished may be what this prompt starts with: a few ms
      await asyncio.wait(list(self._filings))
    reused = await self.inference_engine.start_from_prefix(request.id, shard, keys if reuse else [], tokens.shape[1] - 1)
    request.positions = reused
    request.prompt = (shard, tokens) if reused else None  # kept while another node may lack the prefix
    request.sequence = tokens[0].tolist()
    state = {**(inference_state or {}), "prefix": {"keys": keys, "reuse": reused}}
    await self._run(shard, tokens[:, reused:], request, state, accepted)

  async def _file_answer(self, request: Request) -> None:
    """On the first node, once the request has finished: every node files the blocks its cache holds, the answer's
    included. The others are told first, so that no later request is sent to reuse blocks a peer never heard of."""
    keys = block_keys(request.model, np.array(request.sequence, dtype=np.int64))
    if len(keys) * BLOCK <= request.prompt_tokens:  # the answer completed no block past the prompt's
      return
    status, peers = statuses.prefix_extend(request.id, keys), [p for p in self.peers if p.id() in request.ring]
    # A peer the status misses answers a later request with prefix_miss, which stays correct.
    await asyncio.gather(*[asyncio.wait_for(p.send_opaque_status(request.id, status), FILING_TIMEOUT_S) for p in peers], return_exceptions=True)
    self.inference_engine.extend_prefix(request.id, keys)

  def _ring_reuses_prefixes(self, request: Request) -> bool:
    return (self.inference_engine.reuses_prefixes
            and all(self.peer_prefix_blocks.get(n) == BLOCK for n in request.ring if n != self.id))

  async def announce_structured_output(self) -> None:
    """Tell the ring that this node follows requests' grammars when it samples them (upstream nodes never say)."""
    if grammar.available():
      await self.broadcast_opaque_status("", statuses.structured_output(self.id, grammar.ENGINE))

  async def announce_prefix_cache(self) -> None:
    """Tell the ring whether this node reuses prompt prefixes (block 0: it does not). Upstream nodes never say."""
    block = BLOCK if self.inference_engine.reuses_prefixes else 0
    await self.broadcast_opaque_status("", statuses.prefix_cache(self.id, block))

  async def _start_from_prefix(self, shard: Shard, request: Request, prefix: dict) -> bool:
    """On a node after the first: the request's cache starts afresh with the prefix its first node reused. False
    (and the first node told) if this node does not hold it."""
    reuse, engine = prefix["reuse"], self.inference_engine
    held = await engine.start_from_prefix(request.id, shard, prefix["keys"], reuse) if engine.reuses_prefixes else 0
    if held != reuse:
      print(f"exo: request {request.id} was sent to reuse {reuse} cached positions that this node does not hold; "
            "its prompt runs again, whole", flush=True)
      self.spawn(self.broadcast_opaque_status(request.id, statuses.prefix_miss(request.id, self.id)))
      return False
    request.positions = reuse
    return True

  async def _prefill_again(self, request: Request) -> None:
    """A node lacked the prefix the request reused: its whole prompt runs again, on every node, from position 0."""
    (shard, tokens), request.prompt = request.prompt, None
    try:
      await self._run_from_prefix(shard, tokens, request, {}, reuse=False)
    except RequestEnded:
      pass
    except Exception as e:
      await self.fail_request(request.id, e)

  async def process_tensor(self, base_shard: Shard, tensor: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None,
                           accepted: Optional[asyncio.Future] = None) -> Optional[np.ndarray]:
    """Run this node's layers for a request's tensor, then what follows. `accepted` as for process_prompt."""
    shard = self.get_current_shard(base_shard)
    request = self._open(request_id or str(uuid.uuid4()))
    if request is None:  # a hop still in flight when the request ended: going on would revive it
      return None
    try:
      await self._enter(request, shard)
      prefix = (inference_state or {}).get("prefix")
      if prefix is not None and not await self._start_from_prefix(shard, request, checked_prefix(prefix)):
        return None
      if request.sequence is not None:  # a token fed back to the first node
        request.sequence += np.asarray(tensor).reshape(-1).tolist()
      await self._run(shard, tensor, request, inference_state, accepted)
    except RequestEnded:
      pass
    except Exception as e:
      await self.fail_request(request.id, e)
    return None

  async def _enter(self, request: Request, shard: Shard) -> None:
    """Wait until this node's engine serves the request's model (see ModelGate). Every message of the request
    waits for its one turn: a second one that arrives while the first still waits must not run on the engine
    (it would load the model under the requests that hold the gate)."""
    if request.admitted is None:  # its first work here
      request.model = shard.model_id
      request.ring = request.ring or self.ring_ids()
      request.admitted = asyncio.ensure_future(self.model_gate.enter(request.id, shard.model_id))
      # Its waiters may all be gone (cancelled) when it ends in an error: that error is no one's to log.
      request.admitted.add_done_callback(lambda admitted: admitted.cancelled() or admitted.exception())
    try:
      await asyncio.shield(request.admitted)
    except LeftTheLine:
      raise RequestEnded(request.id) from None
    request.advance(Status.PREFILLING)

  async def _run(self, shard: Shard, tensor: np.ndarray, request: Request, inference_state: Optional[dict], accepted: Optional[asyncio.Future] = None) -> None:
    """This node's layers for the request, then what follows (sampling, forwarding)."""
    if request.busy:  # a second copy of a message (a peer's bug or mischief) must not run on the same cache
      print(f"exo: dropped a second pass of request {request.id} that arrived while its pass ran here", flush=True)
      return
    request.busy = True
    try:
      result, state = await self.infer_tensor(shard, tensor, request.id, inference_state, accepted)
    finally:
      request.busy = False
    if not self.requests.is_live(request.id):  # it ended while the pass ran, which may have made a cache again
      self._release(request.id)
      raise RequestEnded(request.id)
    prefix = (state or {}).get("prefix")
    if prefix is not None:  # its prompt has run here
      self.inference_engine.remember_prefix(request.id, prefix["keys"])
      if shard.is_last_layer():  # the ring has it all: the tokens that follow travel without it
        state = {k: v for k, v in state.items() if k != "prefix"}
    request.positions += input_length(tensor)
    request.advance(Status.DECODING)
    await self.process_inference_result(shard, result, request.id, state)

  async def infer_tensor(self, shard: Shard, tensor: np.ndarray, request_id: str, inference_state: Optional[dict], accepted: Optional[asyncio.Future] = None):
    return await self.plugins.hook.exo_infer_tensor(node=self, shard=shard, tensor=tensor, request_id=request_id, inference_state=inference_state,
                                                    accepted=accepted)

  async def infer_unbatched(self, shard: Shard, tensor: np.ndarray, request_id: str, inference_state: Optional[dict]):
    """The engine alone, a long prompt in PROMPT_CHUNK pieces so that an end stops it between two of them."""
    engine, length = self.inference_engine, input_length(tensor)
    if length <= PROMPT_CHUNK:
      return await engine.infer_tensor(request_id, shard, tensor, inference_state)
    outputs = []
    for start in range(0, length, PROMPT_CHUNK):
      if not self.requests.is_live(request_id):
        raise RequestEnded(request_id)
      output, inference_state = await engine.infer_tensor(request_id, shard, tensor[:, start:start + PROMPT_CHUNK], inference_state)
      outputs.append(output)
    # Hidden states go on whole; on the last layer only the last position is ever sampled.
    return (outputs[-1] if shard.is_last_layer() else np.concatenate(outputs, axis=1)), inference_state

  async def process_inference_result(self, shard, result: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None):
    return await self.plugins.hook.exo_process_inference_result(node=self, shard=shard, result=result, request_id=request_id, inference_state=inference_state)

  async def process_inference_result_unbatched(self, shard: Shard, result: np.ndarray, request_id: str, inference_state: Optional[dict]) -> None:
    if not shard.is_last_layer():
      self.forward_or_finish(shard, result, request_id, inference_state, is_finished=False)
      return
    token = (await self.sample_tokens(shard, [result], [request_id]))[0]
    if isinstance(token, Exception):
      raise token
    self.handle_token(shard, token, request_id, inference_state)

  async def sample_tokens(self, shard: Shard, results: List[np.ndarray], request_ids: List[str], masks: Optional[List[Optional[np.ndarray]]] = None,
                          mask_times: Optional[MaskTimes] = None) -> List[Union[int, Exception]]:
    """Sample each request's next token from its logits, each with its own parameters, random stream and grammar
    (exo/inference/constrained.py; `masks` may hold grammar masks computed already). A request whose grammar this
    node cannot follow gets an error in place of its token."""
    requests = [self.requests.get(rid) or Request(rid, SamplingParams()) for rid in request_ids]  # (an ended one's token is dropped)
    return await constrained.sample_requests(self.inference_engine, requests, results, f"node {self.id}", masks, mask_times)

  def handle_token(self, shard: Shard, token: int, request_id: str, inference_state: Optional[dict]) -> None:
    """After sampling on the last layer: record, check EOS / length / context, fire callbacks, broadcast, forward."""
    request = self.requests.get(request_id)
    if request is None:  # it ended while it was being sampled
      return
    request.tokens.append(token)
    logprobs, request.sampled_logprobs = request.sampled_logprobs, None
    if request.eos_ids is None:  # the engine serves the request's model (ModelGate), so its tokenizer is the request's
      request.eos_ids = eos_ids(self.inference_engine.tokenizer)
    limit = min(request.params.max_tokens or self.max_generate_tokens, self.max_generate_tokens)
    context = self._context_length()
    is_finished = ((token in request.eos_ids and not request.params.ignore_eos) or len(request.tokens) >= limit
                   or (context is not None and request.positions >= context) or (request.constraint is not None and request.constraint.finished))
    if DEBUG >= 2:
      print(f"[{request_id}] token {token} ({len(request.tokens)}/{limit}) finished={is_finished}")
    # The ring waits for the token, the client can wait a moment: local callbacks (streaming to clients) run on the
    # next turn of the event loop, after the next hop's send has started.
    self.forward_or_finish(shard, np.array([[token]], dtype=np.int64), request_id, inference_state, is_finished)
    asyncio.get_running_loop().call_soon(self.trigger_on_token_callbacks, request_id, [token], is_finished, logprobs and [logprobs])
    # Each token goes to the node whose client waits for it; the last one goes to every node, which ends the request
    # there. (Upstream sends every token to every peer; a request from an upstream node has no known origin.) Its
    # logprobs go to the origin as a status just before it, so they are there when it arrives.
    to = None if is_finished or request.origin is None else request.origin
    if any(to is None or peer.id() == to for peer in self.peers):
      preface = {request.origin: statuses.token_logprobs(request_id, len(request.tokens) - 1, logprobs)} if logprobs and request.origin else None
      self.spawn(self.broadcast_result(request_id, [token], is_finished, to, preface))

  def _context_length(self) -> Optional[int]:
    return self.inference_engine.context_length

  def forward_or_finish(self, shard: Shard, forward: np.ndarray, request_id: str, inference_state: Optional[dict], is_finished: bool) -> None:
    if is_finished:
      self.end_request(request_id, Status.FINISHED)
      return
    self.spawn(self._forward_next(shard, forward, request_id, inference_state))

  async def _forward_next(self, shard: Shard, tensor: np.ndarray, request_id: str, inference_state: Optional[dict]) -> None:
    target = self.get_partition_index(offset=1)
    try:
      await self.forward_tensor(shard, tensor, request_id, target, inference_state)
    except Exception as e:
      where = self.partitions()[target].node_id if target is not None else "the next node"
      await self.fail_request(request_id, f"could not forward to node {where}: {e}")

  # --- the ring ---

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

  async def update_peers(self, wait_for_peers: int = 0) -> bool:
    changed, added, removed, moved = await self._update_peers(wait_for_peers)
    if changed:
      # Layer ranges follow membership, so requests in flight lost their place in the ring (and KV caches): end them
      # with an error now rather than leave their clients waiting for tokens that will not come.
      gone = {p.id(): p for p in removed}
      why = f"the ring changed during the request (joined {[p.id() for p in added]}, left {list(gone)}, moved {[p.id() for p in moved]})"
      errors_for: Dict[str, List[Tuple[str, str]]] = {}  # per node that left: (request id, its request_error status)
      for request in self.requests:
        lost = [gone[n] for n in request.ring if n in gone]
        if request.ring and not lost and not added and not any(p.id() in request.ring for p in moved):
          continue  # it never needed the nodes that changed
        message = f"node {lost[0].id()} at {lost[0].addr()} left the ring during the request" if lost else why
        self.spawn(self.fail_request(request.id, message))
        for peer in lost:
          errors_for.setdefault(peer.id(), []).append((request.id, statuses.request_error(request.id, message)))
      for peer_id, errors in errors_for.items():
        self.spawn(self._tell_departed(gone[peer_id], errors))
    return changed

  async def _tell_departed(self, peer, errors: List[Tuple[str, str]]) -> None:
    """A node that left this node's ring (it may only have missed health checks) may still hold the requests
    that crossed it, which no later status reaches: tell it they failed, best effort, then close the channel."""
    try:
      for request_id, status in errors:
        await asyncio.wait_for(peer.send_opaque_status(request_id, status), PEER_CALL_TIMEOUT_S)
    except Exception as e:
      if DEBUG >= 1:
        print(f"Could not tell departed node {peer.id()} that its requests failed: {e!r}")
    finally:
      await peer.disconnect()

  async def _watch_peers(self) -> None:
    """Health-check the peers live requests need; a dead one ends them, with an error naming it."""
    while True:
      await asyncio.sleep(PEER_CHECK_S)
      needed = {n for request in self.requests for n in request.ring} - {self.id}
      peers = [p for p in self.peers if p.id() in needed]
      healthy = await asyncio.gather(*[p.health_check() for p in peers], return_exceptions=True)
      for peer, ok in zip(peers, healthy):
        if ok is True or peer not in self.peers:  # one that left the ring meanwhile: update_peers ends its requests
          continue
        for request in self.requests:
          if peer.id() in request.ring:
            self.spawn(self.fail_request(request.id, f"node {peer.id()} at {peer.addr()} stopped answering during the request"))

  async def periodic_topology_collection(self, interval: float) -> None:
    while True:
      await asyncio.sleep(interval)
      try:
        if await self.update_peers():
          await self.broadcast_supported_engines(self.get_supported_inference_engines())
        await self.announce_prefix_cache()  # every round: a peer may have dropped it before it knew this node
        await self.announce_structured_output()
        await self.collect_topology(set())
        self.forget_stale()
      except Exception as e:
        if DEBUG >= 1:
          print(f"Error collecting topology: {e!r}")

  def forget_stale(self, now: Optional[float] = None) -> None:
    """Forget old ended ids, and parameters a peer sent for requests that never came here."""
    for request in self.requests.sweep(now):
      if request.model is None:
        self.requests.end(request.id, Status.CANCELLED)

  async def collect_topology(self, visited: Set[str], max_depth: int = 4):
    topology = await super().collect_topology(visited, max_depth)
    if self.topology_viz:
      self.topology_viz.update_visualization(self.topology, self.partitions(), self.id, self.node_download_progress)
    return topology

  def get_supported_inference_engines(self) -> List[str]:
    name = self.inference_engine.__class__.__name__
    return [short for short, cls in inference_engine_classes.items() if cls == name and short != "dummy"]

  async def broadcast_supported_engines(self, supported_engines_names: List[str]) -> None:
    if supported_engines_names:
      await self.broadcast_opaque_status("", json.dumps({"type": statuses.SUPPORTED_ENGINES, "node_id": self.id, "engines": supported_engines_names}))

  def get_topology_inference_engines(self) -> List[List[str]]:
    return list(self.peer_engines.values())

  # --- what peers send ---

  @property
  def on_token(self) -> AsyncCallbackSystem[str, Tuple[str, List[int], bool]]:
    return self._on_token

  def trigger_on_token_callbacks(self, request_id: str, tokens: List[int], is_finished: bool, logprobs: Optional[list] = None) -> None:
    watcher = self._watchers.get(request_id)
    if watcher is not None:
      watcher.put_nowait(RequestEvent(list(tokens), is_finished, None, logprobs))
    self._on_token.trigger_all(request_id, tokens, is_finished)

  def on_result(self, request_id: str, result: List[int], is_finished: bool, sender_host: Optional[str] = None) -> None:
    """A peer's SendResult: tokens for a local client; the last one ends the request here too."""
    if self.requests.ended(request_id) is not None:
      return
    request = self.requests.get(request_id)
    if is_finished and request is not None and sender_host is not None and not self._on_path(request, sender_host):
      if DEBUG >= 1:
        print(f"Ignoring the end of {request_id} from {sender_host}, which is not on its path")
      return
    logprobs = None
    if request is not None:
      if request.params.logprobs is not None:
        logprobs = [request.peer_logprobs.pop(request.tokens_received + i, None) for i in range(len(result))]
      request.tokens_received += len(result)
    self.trigger_on_token_callbacks(request_id, result, is_finished, logprobs)
    if is_finished and request is not None:
      self.end_request(request_id, Status.FINISHED)

  def _on_path(self, request: Request, host: str, origin_only: bool = False) -> bool:
    """Whether a call from `host` comes from the request's origin (or, unless origin_only, a node it runs on)."""
    senders = self.peers_at(host)
    allowed = {request.origin} if origin_only and request.origin else {request.origin, *request.ring}
    return bool(senders & allowed) or not (request.origin or request.ring)

  def receive_status(self, request_id: str, raw: str, sender_host: Optional[str] = None) -> None:
    """A peer's SendOpaqueStatus: checked, acted on if it concerns a request, then passed to the observers."""
    try:
      kind, status = statuses.parse(raw)
    except statuses.InvalidStatus as e:
      print(f"exo: dropped an invalid status from {sender_host or 'a peer'}: {e}", flush=True)
      return
    if kind == statuses.REQUEST_PARAMS:
      request = self._open(status["request_id"])
      if request is not None and request.model is None:  # parameters can no longer change once it runs here
        request.params, request.origin = statuses.sampling_params(status["params"]), status.get("origin")
    elif kind == statuses.TOKEN_LOGPROBS:
      self._take_logprobs(status, sender_host)
    elif kind in statuses.REQUEST_ENDS:
      request_id_ = status["request_id"]
      request = self.requests.get(request_id_)
      if request is not None and sender_host is not None and not self._on_path(request, sender_host, origin_only=kind == statuses.CANCEL_REQUEST):
        print(f"exo: dropped a {kind} for {request_id_} from {sender_host}, which is not its origin or on its path", flush=True)
        return
      if request is None:
        self.requests.end(request_id_, Status.FAILED)  # not seen here yet: a late hop must not start it
      elif kind == statuses.CANCEL_REQUEST:
        self.end_request(request_id_, Status.CANCELLED)
      else:
        self.end_request(request_id_, Status.FAILED, status["error"])
    elif kind == statuses.PREFIX_MISS:
      request = self.requests.get(status["request_id"])
      if request is not None and request.prompt is not None and (sender_host is None or self._on_path(request, sender_host)):
        self.spawn(self._prefill_again(request))
    elif kind == statuses.PREFIX_EXTEND and (sender_host is None or self.peers_at(sender_host)):
      self.inference_engine.extend_prefix(status["request_id"], status["keys"])
    self._on_opaque_status.trigger_all(request_id, raw)

  def _take_logprobs(self, status: dict, sender_host: Optional[str]) -> None:
    """Keep a token's logprobs until the token itself arrives: only for a request of ours that asked for them, from a
    node on its path, for a token not yet received and at most PEER_LOGPROBS_AHEAD tokens ahead."""
    request, position = self.requests.get(status["request_id"]), status["position"]
    if (request is None or request.origin != self.id or request.params.logprobs is None or len(status["top"]) > request.params.logprobs
        or not request.tokens_received <= position < request.tokens_received + PEER_LOGPROBS_AHEAD
        or (sender_host is not None and not self._on_path(request, sender_host))):
      if DEBUG >= 1:
        print(f"Ignoring token logprobs for {status['request_id']} (position {position}) from {sender_host}")
      return
    request.peer_logprobs[position] = statuses.logprobs_of(status)

  def on_node_status(self, request_id: str, opaque_status: str) -> None:
    """The built-in status observer: who is working (active_node_id), download progress, the peers' engines."""
    try:
      kind, status = statuses.parse(opaque_status)
    except statuses.InvalidStatus:
      return
    known = {self.id, *self.peer_hosts}
    if kind == statuses.NODE_STATUS:
      if status["status"].startswith("start_"):
        self.topology.active_node_id = status["node_id"]
        if status["status"] == "start_process_prompt" and status["node_id"] != self.id and self.partitioning_strategy:
          self.spawn(self._preload(statuses.shard(status["shard"])))
      elif status["status"].startswith("end_") and status["node_id"] == self.topology.active_node_id:
        self.topology.active_node_id = None
    elif kind == statuses.DOWNLOAD_PROGRESS and status["node_id"] in known:
      try:
        self.node_download_progress[status["node_id"]] = RepoProgressEvent.from_dict(status["progress"])
      except (KeyError, TypeError, ValueError) as e:
        if DEBUG >= 1:
          print(f"Ignoring malformed download progress: {e!r}")
    elif kind == statuses.SUPPORTED_ENGINES and status["node_id"] in self.peer_hosts:
      self.peer_engines[status["node_id"]] = status["engines"]
    elif kind == statuses.PREFIX_CACHE and status["node_id"] in self.peer_hosts:
      self.peer_prefix_blocks[status["node_id"]] = status["block"]
    elif kind == statuses.STRUCTURED_OUTPUT and status["node_id"] in self.peer_hosts:
      self.peer_grammar_engines[status["node_id"]] = status["engine"]
    if self.topology_viz:
      self.topology_viz.update_status(status)

  async def _preload(self, shard: Shard) -> None:
    """Start loading our own layers as soon as any node starts a prompt for a model, unless that would disturb the
    requests this node serves. The download leaves the model gate open (it may take minutes); the load holds it, so
    no request for another model starts meanwhile."""
    try:
      card = model_card(shard.model_id)
    except ValueError:  # a local checkpoint this node does not serve
      return
    if card is None or card["layers"] != shard.n_layers or not self.model_gate.idle_for(shard.model_id):
      return
    holder = f"preload-{uuid.uuid4()}"
    try:
      own = self.get_current_shard(shard)
      await self.shard_downloader.ensure_shard(own, self.inference_engine.__class__.__name__)
      if not self.model_gate.hold_if_idle(holder, shard.model_id):
        return
      await self.inference_engine.ensure_shard(own)
    except Exception as e:
      if DEBUG >= 1:
        print(f"Preloading {shard.model_id} failed: {e!r}")
    finally:
      self.model_gate.leave(holder)

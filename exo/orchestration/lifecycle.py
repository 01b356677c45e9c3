"""How requests start and end on a node, and what its local clients hear of them.

A request starts at its origin (`start_request`) and ends once: finished where its last token is sampled, cancelled by
its origin, or failed anywhere (both travel to its route as statuses); every node then drops it before its next step
and frees its KV cache. Its local client (`watch`) hears its tokens and, when it ends otherwise, why."""
import asyncio
import logging
from typing import Dict, List, Optional, Set, Union

from exo.inference.grammar import CannotConstrain
from exo.inference.sampling import SamplingParams
from exo.inference.shard import Shard
from exo.logs import VERBOSE
from exo.orchestration import statuses
from exo.orchestration.requests import Request, RequestEvent, Status

log = logging.getLogger(__name__)

PEER_LOGPROBS_AHEAD = 64  # a token's logprobs may arrive at most this many tokens before the token itself


class Lifecycle:
  def __init__(self, node):
    self.node = node
    self.watchers: Dict[str, asyncio.Queue] = {}  # request id -> its local client's events (see `watch`)
    self.releases: Set[asyncio.Task] = set()  # KV caches being freed: stop() waits for these, never cancels them
    node.inbox.on_peer(statuses.REQUEST_PARAMS, self._heard_params)
    node.inbox.on_peer(statuses.TOKEN_LOGPROBS, self._heard_logprobs)
    for kind in statuses.REQUEST_ENDS:
      node.inbox.on_peer(kind, self._heard_end)

  def open_request(self, request_id: str) -> Optional[Request]:
    return self.node.requests.open(request_id, SamplingParams(temperature=self.node.default_sample_temperature))

  def watch(self, request_id: str) -> asyncio.Queue:
    """Events of one request for its local client (RequestEvent); only this request's tokens wake it."""
    self.watchers[request_id] = asyncio.Queue()
    return self.watchers[request_id]

  def unwatch(self, request_id: str) -> None:
    self.watchers.pop(request_id, None)

  async def start_request(self, request_id: str, params: SamplingParams, base_shard: Optional[Shard] = None,
                          prompt_ids: Optional[List[int]] = None) -> None:
    """Open the request here (its origin) and pick its group where routes are on (its parameters then travel with its
    prompt); otherwise tell every node its sampling parameters before its prompt enters the ring."""
    request = self.node.requests.open(request_id, params, self.node.id)
    if request is None:
      raise ValueError(f"request {request_id} has already ended")
    request.params = params
    route = self.node.forwarding.route_new(request, base_shard, prompt_ids) if base_shard is not None else None
    sampler = route.hops[-1].node_id if route is not None else self.node.ring_ids()[-1]
    if params.grammar and sampler != self.node.id and sampler not in self.node.peer_grammar_engines:
      # Its grammar would be ignored there (an upstream node, or one before structured output): no unconstrained answer.
      raise CannotConstrain(f"node {sampler}, which samples this model's tokens, has not said that it can constrain output; "
                            "it may run an exo without structured output, so the request is not run")
    if route is not None:
      return
    await self.node.broadcast_opaque_status(request_id, statuses.RequestParams.build(request_id=request_id, params=params, origin=self.node.id))

  async def cancel_request(self, request_id: str) -> None:
    """Stop the request everywhere (its client left or has what it wanted)."""
    request = self.node.requests.get(request_id)
    if self.end_request(request_id, Status.CANCELLED):
      await self.node.forwarding.tell(request, request_id, statuses.CancelRequest.build(request_id=request_id))

  async def fail_request(self, request_id: str, error: BaseException | str) -> None:
    """End a request with an error on every node of its route, so its client gets the error instead of waiting."""
    message = (str(error) or repr(error)) if isinstance(error, BaseException) else error
    log.log(VERBOSE, "Request %s failed on %s: %s", request_id, self.node.id, message)
    if isinstance(error, BaseException):
      log.debug("Request %s failed here with", request_id, exc_info=error)
    request = self.node.requests.get(request_id)
    if self.end_request(request_id, Status.FAILED, message):
      await self.node.forwarding.tell(request, request_id, statuses.RequestError.build(request_id=request_id, error=message))

  def end_request(self, request_id: str, status: Status, error: Optional[str] = None) -> bool:
    """End the request here, whatever it is doing (queues, KV cache, its local client told why). True if it was live."""
    request = self.node.requests.end(request_id, status)
    if request is None:
      return False
    if request.model is not None:
      self.release_cache(request_id, request.engine)  # before the gate lets another model in: the engine loads it only once caches are gone
      if status is Status.FINISHED:
        self.node.prefix_protocol.finished(request)
    if status is not Status.FINISHED:
      self.node.forwarding.router.ended(request_id)
    self.node.model_gate.leave(request_id)
    self.node.steps.forget(request_id)
    self.node.plugins.hook.exo_request_ended(node=self.node, request_id=request_id)
    watcher = self.watchers.get(request_id)
    if watcher is not None and status is not Status.FINISHED:
      watcher.put_nowait(RequestEvent([], True, error or f"the request was {status.value}"))
    return True

  def release_cache(self, request_id: str, engine=None) -> None:
    """Free the request's KV cache on `engine`, the one its model runs on (the node's own when None)."""
    release = asyncio.create_task((engine or self.node.inference_engine).finish_request(request_id))
    self.releases.add(release)
    release.add_done_callback(self.releases.discard)

  def accepts_prompt(self, request_id: str) -> None:
    """Raise ValueError if a prompt for `request_id` must not start (it has ended, or already has one)."""
    ended = self.node.requests.ended(request_id)
    if ended is not None:
      raise ValueError(f"request {request_id} has already {ended.value}")
    request = self.node.requests.get(request_id)
    if request is not None and request.status is not Status.QUEUED:
      raise ValueError(f"request {request_id} already has its prompt ({request.status.value})")

  def on_result(self, request_id: str, result: List[int], is_finished: bool, sender_host: Optional[str] = None) -> None:
    """A peer's SendResult (or a token that reached this node otherwise); the last one ends the request here too."""
    if self.node.requests.ended(request_id) is not None:
      return
    request = self.node.requests.get(request_id)
    if is_finished and request is not None and sender_host is not None and not self.node.on_path(request, sender_host):
      log.log(VERBOSE, "Ignoring the end of %s from %s, which is not on its path", request_id, sender_host)
      return
    logprobs = None
    if request is not None:
      delivery = request.delivered_here()
      if request.params.logprobs is not None:
        logprobs = [delivery.logprobs_ahead.pop(delivery.received + i, None) for i in range(len(result))]
      delivery.received += len(result)
      request.advance(Status.DECODING)
    self.node.trigger_on_token_callbacks(request_id, result, is_finished, logprobs)
    if is_finished and request is not None:
      self.end_request(request_id, Status.FINISHED)

  def forget_stale(self, now=None) -> None:
    """Forget old ended ids, and parameters a peer sent for requests that never came here."""
    for request in self.node.requests.sweep(now):
      if request.model is None:
        self.node.requests.end(request.id, Status.CANCELLED)

  def _heard_params(self, request_id: str, status: statuses.RequestParams, sender_host: Optional[str]) -> None:
    request = self.open_request(status.request_id)
    if request is not None and request.model is None:  # parameters can no longer change once it runs here
      request.params, request.origin = status.params, status.origin

  def _heard_end(self, request_id: str, status: Union[statuses.CancelRequest, statuses.RequestError], sender_host: Optional[str]) -> Optional[bool]:
    cancel, request = status.type == statuses.CANCEL_REQUEST, self.node.requests.get(status.request_id)
    if request is not None and sender_host is not None and not self.node.on_path(request, sender_host, origin_only=cancel):
      log.warning("exo: dropped a %s for %s from %s, which is not its origin or on its path", status.type, status.request_id, sender_host)
      return False
    if request is None:
      self.node.requests.end(status.request_id, Status.FAILED)  # not seen here yet: a late hop must not start it
    else:
      self.end_request(status.request_id, Status.CANCELLED if cancel else Status.FAILED, None if cancel else status.error)

  def _heard_logprobs(self, request_id: str, status: statuses.TokenLogprobsStatus, sender_host: Optional[str]) -> None:
    """Keep a token's logprobs until the token arrives (ours, asked for, from its path, at most PEER_LOGPROBS_AHEAD ahead)."""
    request, position = self.node.requests.get(status.request_id), status.position
    if (request is None or request.origin != self.node.id or request.params.logprobs is None or len(status.top) > request.params.logprobs
        or not 0 <= position - request.delivered_here().received < PEER_LOGPROBS_AHEAD
        or (sender_host is not None and not self.node.on_path(request, sender_host))):
      log.log(VERBOSE, "Ignoring token logprobs for %s (position %s) from %s", status.request_id, position, sender_host)
      return
    request.delivered_here().logprobs_ahead[position] = status.logprobs

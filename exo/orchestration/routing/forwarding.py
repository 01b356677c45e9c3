"""How a node passes requests on along their routes, and their tokens back to their origins.

A routed request's prompt goes once to its first hop, then its hidden states hop to hop with the route in the inference
state, one SendTensor per hop per step (packing.py). Its tokens go to the origin only: on the tensor that feeds the
first hop when the origin is that hop, else as one `tokens` status per origin per step. A request without a travelling
route behaves as exo always did. Each group's first node reports each origin's share of its work (`group_load`)."""
import asyncio
import logging
import time
from typing import Awaitable, Dict, List, Optional, Set, Tuple

import numpy as np

from exo.inference.sampling import TokenLogprobs
from exo.inference.shard import Shard
from exo.logs import VERBOSE, level_of
from exo.orchestration import statuses
from exo.orchestration.passes import PROMPT_IDS
from exo.orchestration.requests import Request, Status
from exo.orchestration.ring_member import PEER_CALL_TIMEOUT_S
from exo.orchestration.routing.packing import pack
from exo.orchestration.routing.route import Route
from exo.orchestration.routing.router import REPORT_FRESH_S, REPORT_S, Router
from exo.orchestration.steps.core import Hop, StepOutput
from exo.topology.placement import Stage

log = logging.getLogger(__name__)


class Forwarding:
  def __init__(self, node):
    self.node = node
    self.router = Router(node.id)
    self._outbox: Dict[str, List[list]] = {}  # destination -> token rows waiting for its sender
    self._senders: Dict[str, asyncio.Task] = {}
    self._reported: Dict[str, Tuple[dict, float]] = {}  # group -> (loads last reported, when)
    self._here: Set[str] = set()  # groups whose first node this is, with requests when last seen
    node.inbox.on_peer(statuses.TOKENS, self._heard_tokens)
    node.inbox.observe(statuses.GROUP_LOAD, self._heard_load)

  def route_new(self, request: Request, base: Shard, prompt_ids: Optional[List[int]]) -> Optional[Route]:
    """At the origin: the group the request goes to, or None where routes are off."""
    placements = self.node.placements
    placement = placements.placement(base)
    groups = [g for g in placement.groups if placements.available(g)] if placement is not None else []
    if not groups:
      return None
    ready = [g for g in groups if placements.ready(g, base)]
    self._see_loads_here()
    choice = self.router.choose(ready or groups, base.model_id, prompt_ids)
    self.router.sent_to(request.id, choice, base.model_id, prompt_ids, len(prompt_ids or ()))
    return self.set_route(request, Route(choice.group.stages, placement.version, self.node.id))

  def set_route(self, request: Request, route: Route) -> Route:
    request.route = route
    if route.travels:
      request.origin = route.origin
    return route

  def route_of(self, request: Request, base: Shard, state: Optional[dict]) -> Route:
    """The route this node follows for the request: the one it brought (checked), the one it has, or the ring this
    node derives from its topology. ValueError if it brought one that differs."""
    data = (state or {}).get("route")
    if data is not None and request.route is not None and request.route.travels and (data is request.route or data == request.route.json):
      return request.route  # the route it came with before: nothing more to check
    if data is not None:
      route = Route.of(data, base.n_layers)
      if request.route is not None and request.route != route:
        raise ValueError(f"request {request.id} came with another route than the one it had here")
      if request.route is None:
        self._check_servable(route, base)
        self.set_route(request, route)
        if "params" in state and request.model is None:
          request.params = statuses.sampling_params(state["params"])
      return request.route
    if request.route is None:
      self.set_route(request, self.ring_route(base))
    return request.route

  def _check_servable(self, route: Route, base: Shard) -> None:
    """A route may only give this node layers it can serve (Placements.can_serve)."""
    own = route.shard_of(self.node.id, base)
    placements = self.node.placements
    if own is not None and not placements.can_serve(own):
      raise LookupError(f"node {self.node.id} cannot serve layers {own.start_layer}-{own.end_layer} of {own.model_id} for this route "
                        f"(placement {route.version}): it holds {_layers(self.node.model_pool.announced())} for requests in flight and "
                        f"is placed to hold {_layers(placements.own_shard(own))}")

  def ring_route(self, base: Shard) -> Route:
    """The ring every node derives from its own view (exo's memory-weighted partition)."""
    node = self.node
    if not node.partitioning_strategy:
      return Route((Stage(node.id, 0, base.n_layers - 1),))
    partitions = node.partitions()
    shards = (node.get_current_shard(base, i) for i in range(len(partitions)))
    return Route(tuple(Stage(p.node_id, s.start_layer, s.end_layer) for p, s in zip(partitions, shards)))

  def outgoing(self, request: Request, state: Optional[dict], to: Stage, prompt: bool = False) -> Optional[dict]:
    """The inference state a hop's message carries: the route, and the parameters on the prompt's first pass."""
    route = request.route
    if route is None or not route.travels:  # a ring route, which upstream nodes may be on: the prompt goes as text only
      return None if state is None else {k: v for k, v in state.items() if k != PROMPT_IDS}
    out = {k: v for k, v in (state or {}).items() if k != "params"}
    out["route"] = route.json
    if prompt or (not request.told_next and to != route.first):
      out["params"] = request.params.to_dict()
    request.told_next = request.told_next or not prompt
    return out

  async def forward_prompt(self, request: Request, base: Shard, prompt: str, state: Optional[dict]) -> None:
    """To the first hop of the request's route (this node is not it)."""
    first = request.route.first
    await self.send_prompt(first, request.route.shard(first, base), prompt, request.id, self.outgoing(request, state, first, prompt=True))

  async def send_prompt(self, to: Stage, shard: Shard, prompt: str, request_id: str, state: Optional[dict]) -> None:
    node = self.node
    log.debug("forward prompt to %s (%s) for %s", to.node_id, shard, request_id)
    if to.node_id == node.id:
      await node.process_prompt(shard, prompt, request_id, state)
    else:
      await self._peer(to.node_id).send_prompt(shard, prompt, request_id=request_id, inference_state=state)

  def send(self, output: StepOutput) -> None:
    """A step's output, sent at once: finished requests end, each next hop gets one message, each origin one token
    message (this node's own clients a turn after the hops' calls start), and failed rows fail their requests."""
    node = self.node
    for request_id in output.finished:
      node.lifecycle.end_request(request_id, Status.FINISHED)
    for hop in output.hops.values():
      sent = self._start_hop(hop)
      task = node.spawn(self._send_hop(hop, sent))
      if asyncio.iscoroutine(sent):  # not awaited where the task is cancelled before it starts (the node stopping)
        task.add_done_callback(lambda _, sent=sent: sent.close())
    loop = asyncio.get_running_loop()
    for token in output.tokens:  # a turn later: after the hops' calls have sent their messages
      loop.call_soon(loop.call_soon, node.trigger_on_token_callbacks, token.request.id, [token.token], token.finished, token.logprobs and [token.logprobs])
      self.send_token(token.request, token.token, token.finished, token.logprobs)
    for request_id, error in output.failed:
      node.spawn(node.lifecycle.fail_request(request_id, error))

  def _start_hop(self, hop: Hop) -> Awaitable[None]:
    """One message for the rows bound to one next hop (a lone row packed too: the next stage has the whole step; to
    this node itself the rows go as they are), started now: a peer's call is on its way before this turn ends."""
    try:
      if hop.packable and hop.to.node_id == self.node.id:
        return self.node.passes.process_rows(hop.shard, [(request_id, tensor, state or {}) for request_id, tensor, state in hop.rows])
      tensor, state = pack(hop.rows) if hop.packable else (hop.rows[0][1], hop.rows[0][2])
      return self.send_tensor(hop.to, hop.shard, tensor, hop.rows[0][0], state)
    except Exception as e:
      return _raise(e)

  async def _send_hop(self, hop: Hop, sent: Awaitable[None]) -> None:
    """Each row's request fails if its hop's message cannot go."""
    try:
      await sent
    except Exception as e:
      for request_id, _, _ in hop.rows:
        await self.node.lifecycle.fail_request(request_id, f"could not forward to node {hop.to.node_id}: {e}")

  def send_tensor(self, to: Stage, shard: Shard, tensor: np.ndarray, request_id: str, state: Optional[dict]) -> Awaitable[None]:
    """Awaitable; a peer's call may start at once (GRPCPeerHandle.start_tensor)."""
    node = self.node
    log.log(level_of(5), "forward tensor %s to %s (%s) for %s", tensor.shape, to.node_id, shard, request_id)
    if to.node_id == node.id:
      return node.process_tensor(shard, tensor, request_id, state)
    peer = self._peer(to.node_id)
    return getattr(peer, "start_tensor", peer.send_tensor)(shard, tensor, request_id, state)

  def _peer(self, node_id: str):
    peer = next((p for p in self.node.peers if p.id() == node_id), None)
    if peer is None:
      raise ValueError(f"node {node_id} is not among this node's peers")
    return peer

  @staticmethod
  def rides_the_ring(request: Request) -> bool:
    """Whether the request's tokens reach its origin, its route's first hop, on the tensors that feed them back."""
    route = request.route
    return (route is not None and route.travels and len(route.hops) > 1 and request.origin == route.first.node_id
            and request.params.logprobs is None)

  def fed_back(self, request: Request, shard: Shard, tensor: np.ndarray) -> None:
    """A token came back to the first hop: if this is the request's origin, the token is its client's."""
    if shard.is_first_layer() and request.origin == self.node.id and self.rides_the_ring(request) and request.status is Status.DECODING:
      self.node.on_result(request.id, [int(t) for t in np.asarray(tensor).reshape(-1)], False)

  def send_token(self, request: Request, token: int, finished: bool, logprobs: Optional[TokenLogprobs]) -> None:
    """After sampling: the token to the request's origin, the last one to every node of its route."""
    node, route = self.node, request.route
    if route is None or not route.travels:  # as exo always did: SendResult to the origin, the last one to every peer
      to = None if finished or request.origin is None else request.origin  # (an upstream origin is unknown)
      if any(to is None or peer.id() == to for peer in node.peers):
        preface = {request.origin: statuses.TokenLogprobsStatus.build(request_id=request.id, position=len(request.sampled_here().tokens) - 1,
                                                                      logprob=logprobs.logprob, top=logprobs.top)} if logprobs and request.origin else None
        node.spawn(node.broadcast_result(request.id, [token], finished, to, preface))
      return
    if not finished and self.rides_the_ring(request):
      return  # it rides back to the origin on the next hop's tensor
    top = None if logprobs is None else [logprobs.logprob, [list(pair) for pair in logprobs.top]]
    to = {request.origin} | (set(route.node_ids) if finished else set())
    for destination in to - {node.id}:
      self._post(destination, [request.id, [token], finished, top if destination == request.origin else None])

  def _post(self, destination: str, row: list) -> None:
    self._outbox.setdefault(destination, []).append(row)
    if destination not in self._senders:
      self._senders[destination] = self.node.spawn(self._send_rows(destination))

  async def _send_rows(self, destination: str) -> None:
    """One status in flight per destination; the rows that arrive meanwhile go together in the next."""
    try:
      while self._outbox.get(destination):
        rows = self._outbox.pop(destination)
        try:
          peer, status = self._peer(destination), statuses.Tokens.build(node_id=self.node.id, rows=rows)
          # gRPC's own call for token rows (uncompressed; each origin takes one a step, so no task of its own around it)
          send = getattr(peer, "send_token_rows", None)
          await (send(status) if send is not None else asyncio.wait_for(peer.send_opaque_status("", status), PEER_CALL_TIMEOUT_S))
        except Exception as e:
          log.log(VERBOSE, "Error sending %d token(s) to %s: %r", len(rows), destination, e)
    finally:
      self._senders.pop(destination, None)
      self._outbox.pop(destination, None)

  def _heard_tokens(self, request_id: str, status: statuses.Tokens, sender_host: Optional[str]) -> None:
    node = self.node
    for rid, tokens, finished, top in status.rows:
      request = node.requests.get(rid)
      if top is not None and request is not None and request.origin == node.id and request.params.logprobs is not None:
        delivery = request.delivered_here()
        delivery.logprobs_ahead[delivery.received] = TokenLogprobs(float(top[0]), [(int(t), float(lp)) for t, lp in top[1]])
      node.on_result(rid, tokens, finished, sender_host)

  async def tell(self, request: Optional[Request], request_id: str, status: str) -> None:
    """A status about a request: to the nodes of its route and its origin (every peer without a travelling route)."""
    route = request.route if request is not None else None
    targets = (set(route.node_ids) | {request.origin}) - {self.node.id} if route is not None and route.travels else None
    await self.node.broadcast_opaque_status(request_id, status, to=targets)

  def _see_loads_here(self) -> Dict[str, Dict[str, List[int]]]:
    """For each group whose first node this is: each origin's [prompt tokens waiting, requests running, waiting]. This
    node's router sees them as they are now, not as last reported."""
    loads: Dict[str, Dict[str, List[int]]] = {}
    for request in self.node.requests:
      route = request.route
      if route is None or not route.travels or route.first.node_id != self.node.id:
        continue
      share = loads.setdefault(route.group, {}).setdefault(request.origin, [0, 0, 0])
      prompt_tokens = request.first_stage.prompt_tokens if request.first_stage is not None else 0
      if request.status is Status.DECODING and request.positions >= prompt_tokens:
        share[1] += 1
      else:
        share[0] += max(1, prompt_tokens - request.positions)
        share[2] += 1
    for group in self._here | set(loads):
      self.router.report(group, {origin: tuple(share) for origin, share in loads.get(group, {}).items()})
    self._here = set(loads)
    return loads

  async def report_loads_periodically(self) -> None:
    """Each origin's share of the groups led here, when it changed (at most every REPORT_S, and before it goes stale)."""
    node = self.node
    while True:
      await asyncio.sleep(REPORT_S)
      if not node.placements.active:
        continue
      now, loads = time.monotonic(), self._see_loads_here()
      for group in set(self._reported) | set(loads):
        current = loads.get(group, {})
        last, when = self._reported.get(group, ({}, -REPORT_FRESH_S))
        if now - when < REPORT_S or (current == last and now - when < REPORT_FRESH_S / 2):
          continue
        self._reported[group] = (current, now)
        node.spawn(node.broadcast_opaque_status("", statuses.GroupLoad.build(node_id=node.id, group=group, loads=current)))
        if not current:
          del self._reported[group]

  def _heard_load(self, request_id: str, status: statuses.GroupLoad, sender_host: Optional[str]) -> None:
    if sender_host is not None and status.node_id in self.node.peers_at(sender_host):
      self.router.report(status.group, status.loads)


async def _raise(error: Exception) -> None:
  raise error


def _layers(shard: Optional[Shard]) -> str:
  return "nothing" if shard is None else f"layers {shard.start_layer}-{shard.end_layer} of {shard.model_id}"

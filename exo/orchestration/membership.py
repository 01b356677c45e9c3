"""Membership and health: what the node does when peers come and go, what they say of themselves (engines, grammars,
prefix reuse, downloads, who is working), and how it notices a peer that died.

When a node of a request's route leaves or stops answering health checks, exactly the requests that need it end with
an error naming it. A node that joins changes nothing where requests carry their routes; on a derived ring (upstream
nodes present, or routes off) every request in flight lost its place and ends too."""
import asyncio
import functools
import logging
import time
from typing import Dict, List, Optional, Tuple

from exo.download.download_progress import RepoProgressEvent
from exo.logs import VERBOSE
from exo.orchestration import statuses
from exo.orchestration.ring_member import PEER_CALL_TIMEOUT_S

log = logging.getLogger(__name__)

PEER_CHECK_S = 2.0  # how often the peers that live requests need are health-checked
# A check that fails sooner than ANSWERED_S was answered (refused, or unhealthy): the peer is dead. One that runs out
# its 5 s timeout may be a live peer busy for a moment: dead only after SLOW_CHECKS_BEFORE_DEAD in a row.
ANSWERED_S = 1.0
SLOW_CHECKS_BEFORE_DEAD = 2
# What a peer says of itself, kept while it is a peer: status kind -> (the node's table, the status's field)
PEER_SAYS = {statuses.SUPPORTED_ENGINES: ("peer_engines", "engines"), statuses.STRUCTURED_OUTPUT: ("peer_grammar_engines", "engine"),
             statuses.PREFIX_CACHE: ("peer_prefix_blocks", "block")}


class Membership:
  def __init__(self, node):
    self.node = node
    self.slow_checks: Dict[str, int] = {}  # per peer: its failed checks in a row that ran out the timeout
    self.clock = time.monotonic
    inbox = node.inbox
    for kind, (table, field) in PEER_SAYS.items():
      inbox.observe(kind, functools.partial(self._heard_says, table, field))
    inbox.observe(statuses.NODE_STATUS, self._heard_node_status)
    inbox.observe(statuses.DOWNLOAD_PROGRESS, self._heard_download_progress)
    if node.topology_viz:
      for kind in (statuses.NODE_STATUS, statuses.REQUEST_ERROR, statuses.DOWNLOAD_PROGRESS):
        inbox.observe(kind, lambda request_id, status, host: node.topology_viz.update_status(status.model_dump()))

  def peers_changed(self, added: List, removed: List, moved: List) -> None:
    """End the requests that needed a node that left or moved (and, on a derived ring, every request if one joined)."""
    node = self.node
    node.placements.peers_changed(added, removed)
    gone = {p.id(): p for p in removed}
    for peer_id in gone:
      self.slow_checks.pop(peer_id, None)
    why = f"the ring changed during the request (joined {[p.id() for p in added]}, left {list(gone)}, moved {[p.id() for p in moved]})"
    errors_for: Dict[str, List[Tuple[str, str]]] = {}  # per node that left: (request id, its request_error status)
    for request in node.requests:
      lost = [gone[n] for n in request.ring if n in gone]
      routed = request.route is not None and request.route.travels
      if request.ring and not lost and (routed or not added) and not any(p.id() in request.ring for p in moved):
        continue  # it never needed the nodes that changed
      message = f"node {lost[0].id()} at {lost[0].addr()} left the ring during the request" if lost else why
      node.spawn(node.lifecycle.fail_request(request.id, message))
      for peer in lost:
        errors_for.setdefault(peer.id(), []).append((request.id, statuses.RequestError.build(request_id=request.id, error=message)))
    for peer_id, errors in errors_for.items():
      node.spawn(self._tell_departed(gone[peer_id], errors))

  async def _tell_departed(self, peer, errors: List[Tuple[str, str]]) -> None:
    """A node that left (it may only have missed health checks) may still hold the requests that crossed it: tell it
    they failed, best effort, then close the channel."""
    try:
      for request_id, status in errors:
        await asyncio.wait_for(peer.send_opaque_status(request_id, status), PEER_CALL_TIMEOUT_S)
    except Exception as e:
      log.log(VERBOSE, "Could not tell departed node %s that its requests failed: %r", peer.id(), e)
    finally:
      await peer.disconnect()

  async def watch_peers(self) -> None:
    while True:
      await asyncio.sleep(PEER_CHECK_S)
      await self.check_peers()

  async def check_peers(self) -> None:
    """Health-check the peers live requests need; a dead one ends them. One that fails a check gets no new request."""
    node = self.node
    needed = {n for request in node.requests for n in request.ring} - {node.id}
    peers = [p for p in node.peers if p.id() in needed or p.id() in node.placements.suspects]
    checks = await asyncio.gather(*[timed_health_check(p, self.clock) for p in peers])
    for peer, (ok, seconds) in zip(peers, checks):
      if ok:
        self.slow_checks.pop(peer.id(), None)
        node.placements.suspects.pop(peer.id(), None)
        continue
      if peer not in node.peers:  # it left the ring meanwhile: update_peers ends its requests
        continue
      node.placements.suspects[peer.id()] = time.monotonic()
      slow = self.slow_checks.pop(peer.id(), 0) + 1
      if seconds >= ANSWERED_S and slow < SLOW_CHECKS_BEFORE_DEAD:  # unanswered, but maybe only busy: not dead yet
        self.slow_checks[peer.id()] = slow
        continue
      how = "its health check failed" if seconds < ANSWERED_S else f"{SLOW_CHECKS_BEFORE_DEAD} health checks in a row went unanswered"
      why = getattr(peer, "health_failure", None)  # the gRPC handle's reason, where the handle keeps one
      message = f"node {peer.id()} at {peer.addr()} stopped answering during the request ({how}{f': {why}' if why else ''})"
      for request in node.requests:
        if peer.id() in request.ring:
          node.spawn(node.lifecycle.fail_request(request.id, message))

  def _heard_says(self, table: str, field: str, request_id: str, status: statuses.Status, sender_host: Optional[str]) -> None:
    if status.node_id in self.node.peer_hosts:
      getattr(self.node, table)[status.node_id] = getattr(status, field)

  def _heard_node_status(self, request_id: str, status: statuses.NodeStatus, sender_host: Optional[str]) -> None:
    node = self.node
    if status.status.startswith("start_"):
      node.topology.active_node_id = status.node_id
      if status.status == "start_process_prompt" and status.node_id != node.id and node.partitioning_strategy:
        node.spawn(node.placements.preload(status.shard))
    elif status.status.startswith("end_") and status.node_id == node.topology.active_node_id:
      node.topology.active_node_id = None

  def _heard_download_progress(self, request_id: str, status: statuses.DownloadProgress, sender_host: Optional[str]) -> None:
    if status.node_id in {self.node.id, *self.node.peer_hosts}:
      try:
        self.node.node_download_progress[status.node_id] = RepoProgressEvent.from_dict(status.progress)
        self.node.node_download_sources[status.node_id] = status.sources
      except (KeyError, TypeError, ValueError) as e:
        log.log(VERBOSE, "Ignoring malformed download progress: %r", e)


async def timed_health_check(peer, clock) -> Tuple[bool, float]:
  """(whether the peer answered healthy, seconds the check took)."""
  started = clock()
  try:
    ok = await peer.health_check() is True
  except Exception:  # noqa: BLE001 (any failure to answer is a failed check)
    ok = False
  return ok, clock() - started

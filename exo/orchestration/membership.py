"""Membership and health: what the node does when peers come and go, and how it notices a peer that died.

A request needs the nodes of its route. When one of them leaves (discovery dropped it) or stops answering health
checks, exactly the requests that need it end with an error naming it; the others go on. A node that joins changes
nothing in flight where requests carry their routes; on a ring where each node derives its layers from its own view
of the members (upstream nodes present, or routes off), every request in flight lost its place and ends too."""
import asyncio
from typing import Dict, List, Tuple

from exo.helpers import DEBUG
from exo.orchestration import statuses
from exo.orchestration.requests import Status
from exo.orchestration.ring_member import PEER_CALL_TIMEOUT_S

PEER_CHECK_S = 2.0  # how often the peers that live requests need are health-checked
# A peer that dies mid-request ends it within PEER_CHECK_S + the health check's 5 s timeout (at once if a send fails).


class Membership:
  def __init__(self, node):
    self.node = node

  def peers_changed(self, added: List, removed: List, moved: List) -> None:
    """End the requests that needed a node that left or moved (and, on a derived ring, every request if one joined)."""
    node = self.node
    node.placements.peers_changed(added, removed)
    gone = {p.id(): p for p in removed}
    why = f"the ring changed during the request (joined {[p.id() for p in added]}, left {list(gone)}, moved {[p.id() for p in moved]})"
    errors_for: Dict[str, List[Tuple[str, str]]] = {}  # per node that left: (request id, its request_error status)
    for request in node.requests:
      lost = [gone[n] for n in request.ring if n in gone]
      routed = request.route is not None and request.route.travels
      if request.ring and not lost and (routed or not added) and not any(p.id() in request.ring for p in moved):
        continue  # it never needed the nodes that changed
      message = f"node {lost[0].id()} at {lost[0].addr()} left the ring during the request" if lost else why
      node.spawn(node.fail_request(request.id, message))
      for peer in lost:
        errors_for.setdefault(peer.id(), []).append((request.id, statuses.request_error(request.id, message)))
    for peer_id, errors in errors_for.items():
      node.spawn(self._tell_departed(gone[peer_id], errors))

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

  async def watch_peers(self) -> None:
    """Health-check the peers live requests need; a dead one ends them, with an error naming it, and no new request
    is routed to it until it answers again."""
    node = self.node
    while True:
      await asyncio.sleep(PEER_CHECK_S)
      needed = {n for request in node.requests for n in request.ring} - {node.id}
      peers = [p for p in node.peers if p.id() in needed or node.placements.is_suspect(p.id())]
      healthy = await asyncio.gather(*[p.health_check() for p in peers], return_exceptions=True)
      for peer, ok in zip(peers, healthy):
        if ok is True:
          node.placements.cleared(peer.id())
          continue
        if peer not in node.peers:  # it left the ring meanwhile: update_peers ends its requests
          continue
        node.placements.suspect(peer.id())
        for request in node.requests:
          if peer.id() in request.ring:
            node.spawn(node.fail_request(request.id, f"node {peer.id()} at {peer.addr()} stopped answering during the request"))

  async def collect_periodically(self, interval: float) -> None:
    node = self.node
    while True:
      await asyncio.sleep(interval)
      try:
        if await node.update_peers():
          await node.broadcast_supported_engines(node.get_supported_inference_engines())
        # Every round: a peer may have dropped what this node announced before it knew this node.
        await node.prefix_protocol.announce()
        await node.announce_structured_output()
        await node.placements.announce()
        await node.collect_topology(set())
        node.forget_stale()
        node.placements.settle()
      except Exception as e:
        if DEBUG >= 1:
          print(f"Error collecting topology: {e!r}")

  def forget_stale(self, now=None) -> None:
    """Forget old ended ids, and parameters a peer sent for requests that never came here."""
    node = self.node
    for request in node.requests.sweep(now):
      if request.model is None:
        node.requests.end(request.id, Status.CANCELLED)

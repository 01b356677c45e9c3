"""Whether the ring this node sees is the ring its peers see.

Every node partitions layers over its own view (self + direct peers, with capabilities as last reported), so a
request is only safe to start once every peer sees the same; right after a node joins, its peers may not know it
yet, or still hold the capabilities discovery advertised for it rather than its own report."""
import asyncio
import logging
import time

from exo.logs import VERBOSE
from exo.topology.topology import Topology

log = logging.getLogger(__name__)


def peers_agree(topology: Topology, node_id: str) -> bool:
  """True when each peer's own edges (from topology collection) cover exactly the members this node sees."""
  members = set(topology.nodes)
  for peer_id in members - {node_id}:
    if {peer_id} | {c.to_id for c in topology.peer_graph.get(peer_id, ())} != members:
      return False
  return True


async def views_agree(node) -> bool:
  """Every peer's own view lists the same nodes with the same capabilities as ours, so all compute one partition."""
  async def view(peer):
    try:
      return await asyncio.wait_for(peer.collect_topology(set(), 0), 5)
    except Exception:
      return None
  views = await asyncio.gather(*[view(peer) for peer in node.peers])
  return all(v is not None and dict(v.nodes) == dict(node.topology.nodes) for v in views)


async def wait_for_agreement(node, timeout: float, interval: float = 0.25) -> bool:
  """Re-collect the topology until the peers agree on the ring and this node has heard every peer's placement facts
  (a request planned before that would be placed on this node alone); False after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while not (peers_agree(node.topology, node.id) and await views_agree(node) and node.placements.heard_all_peers()):
    if time.monotonic() > deadline:
      log.log(VERBOSE, "Peers still disagree on the ring after %s s: %s", timeout, node.topology)
      return False
    await asyncio.sleep(interval)
    await node.collect_topology(set())
  return True

"""What a ring member keeps of its peers lasts while they are peers: a peer that leaves takes what it said of itself
(its engines, its grammar engine, its prefix block) with it."""
import pytest

from exo.orchestration.ring_member import RingMember

pytestmark = pytest.mark.unit


class Peer:
  def __init__(self, peer_id):
    self._id, self.connected = peer_id, False

  def id(self): return self._id
  def addr(self): return "127.0.0.1:1"
  async def connect(self): self.connected = True
  async def is_connected(self): return self.connected
  async def disconnect(self): self.connected = False


class Discovery:
  def __init__(self, peers):
    self.peers = peers

  async def discover_peers(self, wait_for_peers=0):
    return self.peers


async def test_a_peer_that_leaves_takes_what_it_said_of_itself():
  discovery = Discovery([Peer("b"), Peer("c")])
  member = RingMember("a", discovery, None)
  await member._update_peers()
  for peer_id in ("b", "c"):
    member.peer_engines[peer_id] = ["NumpyLlamaEngine"]
    member.peer_grammar_engines[peer_id] = "regex"
    member.peer_prefix_blocks[peer_id] = 16
  discovery.peers = [Peer("c")]
  changed, added, removed, moved = await member._update_peers()
  assert changed and [p.id() for p in removed] == ["b"]
  assert member.peer_engines == {"c": ["NumpyLlamaEngine"]}
  assert member.peer_grammar_engines == {"c": "regex"}
  assert member.peer_prefix_blocks == {"c": 16}

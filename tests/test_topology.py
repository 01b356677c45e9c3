"""Topology, partitioning (upstream's worked examples), ring agreement and the TUI's rendering."""
import io

import pytest
from rich.console import Console

from exo.inference.shard import Shard
from exo.models import model_cards
from exo.topology.device_capabilities import DeviceCapabilities, DeviceFlops
from exo.topology.partitioning_strategy import Partition, map_partitions_to_shards
from exo.topology.ring import peers_agree
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from exo.topology.topology import PeerConnection, Topology
from exo.viz.topology_viz import TopologyViz

pytestmark = pytest.mark.unit

GIB = 1024


def caps(memory: int) -> DeviceCapabilities:
  return DeviceCapabilities(model="test", chip="test chip", memory=memory, flops=DeviceFlops(fp32=0, fp16=0, int8=0))


def topology_of(memories: dict) -> Topology:
  topology = Topology()
  for node_id, memory in memories.items():
    topology.update_node(node_id, caps(memory))
  return topology


def partition(memories: dict):
  return [(p.node_id, p.start, p.end) for p in RingMemoryWeightedPartitioningStrategy().partition(topology_of(memories))]


def layers(shards):
  return [(s.start_layer, s.end_layer) for s in shards]


def test_two_equal_nodes_higher_id_first():
  assert partition({"node1": 1000, "node2": 1000}) == [("node2", 0, 0.5), ("node1", 0.5, 1.0)]


def test_memory_weighted_three_nodes():
  parts = partition({"node1": 3000, "node2": 1000, "node3": 6000})
  assert parts == [("node3", 0, 0.6), ("node1", 0.6, 0.9), ("node2", 0.9, 1.0)]
  shards = map_partitions_to_shards([Partition(*p) for p in parts], 32, "m")
  assert layers(shards) == [(0, 18), (19, 27), (28, 31)]


def test_ties_broken_by_id_descending_with_rounding():
  assert partition({"node1": 128 * GIB, "node2": 192 * GIB, "node3": 128 * GIB}) == [
    ("node2", 0, 0.42857), ("node3", 0.42857, 0.71428), ("node1", 0.71428, 0.99999)]


@pytest.mark.parametrize("parts, expected", [
  ([(0, .42857), (.42857, .71428), (.71428, .99999)], [(0, 12), (13, 21), (22, 31)]),
  ([(0, .1), (.1, .2), (.2, 1.0)], [(0, 2), (3, 5), (6, 31)]),
  ([(0, 1.0)], [(0, 31)]),
  ([], []),
])
def test_map_partitions_to_shards(parts, expected):
  shards = map_partitions_to_shards([Partition(f"n{i}", s, e) for i, (s, e) in enumerate(parts)], 32, "m")
  assert layers(shards) == expected and all(s == Shard("m", a, b, 32) for s, (a, b) in zip(shards, expected))


def test_registry_models_on_two_equal_nodes():
  parts = [Partition(*p) for p in partition({"node1": 1000, "node2": 1000})]
  assert layers(map_partitions_to_shards(parts, model_cards["llama-3.2-1b"]["layers"], "llama-3.2-1b")) == [(0, 7), (8, 15)]
  assert layers(map_partitions_to_shards(parts, model_cards["dummy"]["layers"], "dummy")) == [(0, 3), (4, 7)]


def test_smollm2_on_three_equal_nodes_covers_every_layer_once():
  parts = [Partition(*p) for p in partition({"a": 1, "b": 1, "c": 1})]
  shards = map_partitions_to_shards(parts, 30, "smollm2-135m")
  assert layers(shards) == [(0, 8), (9, 18), (19, 29)]  # int(0.33333 * 30) = 9: upstream rounding, kept


def test_zero_memory_falls_back_to_equal_shares():
  assert [p[0] for p in partition({"a": 0, "b": 0})] == ["b", "a"]
  assert layers(map_partitions_to_shards([Partition(*p) for p in partition({"a": 0, "b": 0})], 8, "m")) == [(0, 3), (4, 7)]


def test_tiny_partitions_are_dropped_without_gaps():
  shards = map_partitions_to_shards([Partition("big", 0, 0.99), Partition("tiny", 0.99, 1.0)], 8, "m")
  assert layers(shards) == [(0, 6), (7, 7)]
  shards = map_partitions_to_shards([Partition("a", 0, 0.5), Partition("tiny", 0.5, 0.51), Partition("b", 0.51, 1.0)], 4, "m")
  assert layers(shards)[0] == (0, 1) and layers(shards)[-1][1] == 3


def test_merge_takes_only_the_peers_own_entry_and_edges():
  mine = topology_of({"me": 1, "peer": 2})
  mine.add_edge("me", "peer", "MAN")
  theirs = topology_of({"peer": 4096, "stranger": 9})
  theirs.add_edge("peer", "me", "MAN")
  theirs.add_edge("stranger", "peer")
  mine.merge("peer", theirs)
  assert mine.nodes["peer"].memory == 4096 and "stranger" not in mine.nodes
  assert mine.peer_graph["peer"] == {PeerConnection("peer", "me")} and "stranger" not in mine.peer_graph
  assert mine.to_json()["peer_graph"]["me"] == [{"from_id": "me", "to_id": "peer", "description": "MAN"}]


def test_peers_agree_only_when_every_peer_sees_the_same_members():
  view = topology_of({"a": 1, "b": 1, "c": 1})
  view.add_edge("a", "b")
  view.add_edge("a", "c")
  view.add_edge("b", "a")
  view.add_edge("b", "c")
  assert not peers_agree(view, "a")  # c has not reported yet (or does not know a)
  view.add_edge("c", "b")
  assert not peers_agree(view, "a")
  view.add_edge("c", "a")
  assert peers_agree(view, "a")
  assert peers_agree(topology_of({"alone": 1}), "alone")


def test_tui_shows_ring_layers_memory_and_requests():
  viz = TopologyViz(chatgpt_api_endpoints=["http://localhost:8000/v1/chat/completions"], web_chat_urls=["http://localhost:8000"])
  topology = topology_of({"node1": 8 * GIB, "node2": 8 * GIB})
  topology.active_node_id = "node2"
  parts = RingMemoryWeightedPartitioningStrategy().partition(topology)
  viz.update_visualization(topology, parts, "node1", {})
  viz.update_status({"type": "node_status", "node_id": "node2", "status": "start_process_prompt", "request_id": "req-12345678",
                     "base_shard": {"model_id": "smollm2-135m", "start_layer": 0, "end_layer": 0, "n_layers": 30},
                     "shard": {"model_id": "smollm2-135m", "start_layer": 0, "end_layer": 14, "n_layers": 30}, "prompt": "What is the capital of France?"})
  viz.update_status({"type": "node_status", "node_id": "node2", "status": "start_process_prompt", "request_id": "req-failing",
                     "base_shard": {"model_id": "smollm2-135m", "start_layer": 0, "end_layer": 0, "n_layers": 30}, "prompt": "Hello"})
  viz.update_status({"type": "request_error", "request_id": "req-failing", "error": "peer gone"})
  console = Console(record=True, width=140)
  console.print(viz.render())
  screen = console.export_text()
  assert "Ring: node2 → node1 → node2" in screen
  assert "0–14 of 30" in screen and "15–29 of 30" in screen and "8.0 GiB" in screen
  assert "node1 (this node)" in screen and "node2 ●" in screen
  assert "capital of France" in screen and "error: peer gone" in screen
  assert "http://localhost:8000/v1/chat/completions" in screen


def test_tui_starts_draws_and_stops():
  viz = TopologyViz()
  viz.console = Console(file=io.StringIO(), force_terminal=True, record=True, width=120)
  viz.start()
  live = viz.live
  assert live.is_started
  viz.update_visualization(topology_of({"a": 1 * GIB}), [Partition("a", 0, 1)], "a")
  live.refresh()  # draw now, not at its next twice-a-second refresh
  viz.stop()
  assert not live.is_started and viz.live is None
  assert "a (this node)" in viz.console.export_text()


def test_a_nodes_shard_follows_every_change_of_its_topology():
  """Node caches its partitions and shards (every message asks several times); a change must show at once."""
  from exo.orchestration.node import Node
  node = Node("a", None, None, None, None, RingMemoryWeightedPartitioningStrategy())
  node.topology = topology_of({"a": 1 * GIB, "b": 1 * GIB})
  base = Shard("smollm2-135m", 0, 0, 30)
  assert (node.get_current_shard(base).start_layer, node.get_partition_index(offset=1)) == (15, 0)
  node.topology.update_node("b", caps(3 * GIB))  # b now takes three quarters, from the start of the ring
  assert layers([node.get_current_shard(base)]) == [(22, 29)]
  node.topology = topology_of({"a": 1 * GIB})  # a fresh topology object (as each collection makes): b has gone
  assert layers([node.get_current_shard(base)]) == [(0, 29)] and node.get_partition_index(offset=1) == 0

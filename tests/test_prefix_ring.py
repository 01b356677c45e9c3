"""Prompt prefix reuse on the real SmolLM2 over a 2-node ring, real gRPC in this process: every node starts from the
same prefix, a node that lacks it says so and the prompt runs again whole, a node that never announced the ability
(as an upstream node) gets no prefix at all, and a finished answer is filed on both nodes."""
import asyncio
import contextlib

import pytest

from exo.inference import llama_engine
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.inference.prefix_cache import BLOCK
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.networking.grpc.grpc_server import GRPCServer
from exo.networking.manual.manual_discovery import ManualDiscovery
from exo.orchestration.node import Node
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.cluster import free_port, record_inference_states, wait_for_ring, write_manual_config
from tests.support.engines import cached_weights, load_engine
from tests.support.prefixes import answer, conversation, prefixes_off, two_turns
from tests.support.waiting import eventually

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def engine(downloader):
  """An engine with SmolLM2 loaded, for its tokenizer."""
  return load_engine(NumpyDynamicShardInferenceEngine, downloader)


async def start_ring_node(node_id: str, port: int, config, downloader) -> Node:
  engine = NumpyDynamicShardInferenceEngine(downloader)
  node = Node(node_id, None, engine, ManualDiscovery(str(config), node_id, GRPCPeerHandle, poll_interval=0.2), downloader,
              RingMemoryWeightedPartitioningStrategy())
  node.server = GRPCServer(node, "127.0.0.1", port)
  await node.start()
  return node


@contextlib.asynccontextmanager
async def two_node_ring(tmp_path, downloader, names):
  """(first, second): two nodes of one ring in this process, by partition order, stopped afterwards."""
  ports = {name: free_port() for name in names}
  config = write_manual_config(tmp_path / "peers.json", ports)
  nodes = [await start_ring_node(node_id, port, config, downloader) for node_id, port in ports.items()]
  try:
    await wait_for_ring(ports, 30)
    await eventually(lambda: all(len(n.partitions()) == 2 for n in nodes), 30)
    yield sorted(nodes, key=lambda n: n.get_partition_index())
  finally:
    await asyncio.gather(*[n.stop() for n in nodes])


async def test_a_ring_reuses_prefixes_on_every_node_and_without_the_ability_stays_correct(tmp_path, downloader, engine, monkeypatch):
  monkeypatch.setattr(llama_engine, "load_shard_weights", cached_weights)
  async with two_node_ring(tmp_path, downloader, ["ring-a", "ring-b"]) as nodes:
    first, second = nodes
    received = record_inference_states(second)
    prompts = conversation(engine, 2)

    # A node that never announced the ability (as an upstream node): the first node reuses nothing and sends no state.
    second.inference_engine.prefixes.enabled = False
    first.peer_prefix_blocks.clear()
    references = [await answer(first, p) for p in prompts]
    assert [await answer(first, p) for p in prompts] == references
    assert first.inference_engine.prefixes.hits == 0 and all(state == {} for state in received)

    # Every node announces: the second turn starts from the first on both nodes, with the same answer.
    second.inference_engine.prefixes.enabled = True
    await second.prefix_protocol.announce()
    await eventually(lambda: first.peer_prefix_blocks.get(second.id) == BLOCK, 10)
    await answer(first, prompts[0])
    assert await answer(first, prompts[1]) == references[1]
    assert first.inference_engine.prefixes.hits == 1 and second.inference_engine.prefixes.hits == 1
    assert any("prefix" in state for state in received)

    # The second node has lost it (evicted, restarted): it says so, and the prompt runs again whole on both.
    second.inference_engine.prefixes.clear()
    assert await answer(first, prompts[1]) == references[1]
    assert first.inference_engine.prefixes.hits == 2 and second.inference_engine.prefixes.hits == 1
    for node in nodes:
      await eventually(lambda: node.state()["kv_bytes"] == 0 and not node.state()["requests"], 10)


async def test_a_ring_files_each_answer_on_every_node(tmp_path, downloader, engine, monkeypatch):
  monkeypatch.setattr(llama_engine, "load_shard_weights", cached_weights)
  async with two_node_ring(tmp_path, downloader, ["answer-a", "answer-b"]) as (first, second):
    await eventually(lambda: first.peer_prefix_blocks.get(second.id) == BLOCK, 10)
    engines = [first.inference_engine, second.inference_engine]
    prompt, _, next_prompt = await two_turns(engine, first, 2 * BLOCK + 1)
    await eventually(lambda: first.pending()["filings"] == 0, 10)  # the answer's blocks are on their way into both stores
    with prefixes_off(*engines):
      reference = await answer(first, next_prompt)
    await second.prefix_protocol.announce()  # it may have announced its cache off meanwhile
    await eventually(lambda: first.peer_prefix_blocks.get(second.id) == BLOCK, 10)
    before = [e.prefixes.reused_positions for e in engines]
    assert await answer(first, next_prompt) == reference
    held = (len(engine.tokenizer.encode(prompt)) + 2 * BLOCK) // BLOCK * BLOCK  # the first turn's answer included
    assert [e.prefixes.reused_positions - b for e, b in zip(engines, before)] == [held, held]

"""A request's grammar across a 2-node ring over real gRPC in this process (SmolLM2 split between the nodes, batching
on): it travels with the request's parameters to the node with the last layers, which samples under it, and the
greedy answer equals a single node's. A sampling node that cannot follow the grammar fails the request with a clear
error, and the origin does not start a constrained request on a ring whose sampling node never said it can."""
import asyncio
import contextlib
import json

import pytest

from exo.inference import llama_engine
from exo.inference.grammar import CannotConstrain
from exo.inference.sampling import SamplingParams
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.networking.grpc.grpc_server import GRPCServer
from exo.networking.manual.manual_discovery import ManualDiscovery
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.plugin import register_batching
from exo.orchestration.generation import GenerationError, generate
from exo.orchestration.node import Node
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.waiting import eventually
from tests.support.cluster import free_port, wait_for_ring, write_manual_config
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.inference.tokenizers import resolve_tokenizer
from tests.support.engines import cached_weights
from tests.support.models import smollm2_shard
from tests.support.schema_suite import SCHEMAS

pytestmark = pytest.mark.cluster

SCHEMA = SCHEMAS["order"]


def grammar_of(schema: dict) -> str:
  from exo.inference.grammar import json_fragment
  return f"start: {json_fragment(schema)}"


async def start_node(node_id: str, port: int, config, downloader) -> Node:
  engine = NumpyDynamicShardInferenceEngine(downloader)
  node = Node(node_id, None, engine, ManualDiscovery(str(config), node_id, GRPCPeerHandle, poll_interval=0.2), downloader,
              RingMemoryWeightedPartitioningStrategy())
  node.server = GRPCServer(node, "127.0.0.1", port)
  register_batching(node, BatchingConfig(8))
  await node.start()
  return node


@contextlib.asynccontextmanager
async def ring(tmp_path, downloader, names):
  ports = {name: free_port() for name in names}
  tmp_path.mkdir(parents=True, exist_ok=True)
  config = write_manual_config(tmp_path / "peers.json", ports)
  nodes = [await start_node(name, port, config, downloader) for name, port in ports.items()]
  try:
    await wait_for_ring(ports, 30)
    await eventually(lambda: all(len(n.partitions()) == len(names) for n in nodes), 30)
    yield sorted(nodes, key=lambda n: n.get_partition_index())
  finally:
    await asyncio.gather(*[n.stop() for n in nodes])


async def answer(node: Node, tokenizer, params: SamplingParams) -> str:
  prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write an example order as JSON."}], tokenize=False)
  tokens = []
  async for new, _ in generate(node, smollm2_shard(), prompt, params, timeout=120):
    tokens += new
  return tokenizer.decode(tokens, skip_special_tokens=True)


async def test_a_grammar_travels_the_ring_and_greedy_answers_equal_one_nodes(tmp_path, downloader, monkeypatch, smollm2_path):
  monkeypatch.setattr(llama_engine, "load_shard_weights", cached_weights)
  tokenizer = resolve_tokenizer(smollm2_path)
  params = SamplingParams(max_tokens=120, grammar=grammar_of(SCHEMA))
  async with ring(tmp_path / "one", downloader, ["solo"]) as (solo,):
    alone = await answer(solo, tokenizer, params)
  json.loads(alone)  # it completed its grammar
  async with ring(tmp_path / "two", downloader, ["first", "second"]) as (first, second):
    await eventually(lambda: second.id in first.peer_grammar_engines, 10)
    assert await answer(first, tokenizer, params) == alone
    assert second.step_core.mask_times.rows > 0  # the second node, which samples, followed the grammar

    # A grammar the sampling node cannot compile (a peer's mistake): the request fails with the reason, never unconstrained.
    with pytest.raises(GenerationError, match="cannot constrain"):
      await answer(first, tokenizer, SamplingParams(max_tokens=20, grammar="start: %json {\"type\": \"nonsense\"}"))

    # The origin does not start a constrained request when the sampling node never said it can (an upstream node).
    first.peer_grammar_engines.clear()
    with pytest.raises(CannotConstrain, match="has not said that it can constrain"):
      await answer(first, tokenizer, params)
    await second.announce()
    await eventually(lambda: second.id in first.peer_grammar_engines, 10)
    for node in (first, second):
      await eventually(lambda: not node.state()["requests"], 10)

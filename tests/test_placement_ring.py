"""Placement and routes on real nodes in this process, joined by real gRPC over loopback, on the real SmolLM2: two
replicas serving one burst, each request following the route its origin gave it; a pipeline cut by speed with the
head counted; a node asked for layers it could only load by disturbing its requests refusing the route; and a ring with a
node that never announces (as an upstream node), which runs as one pipeline over every node, as exo always did."""
import asyncio
import contextlib
import functools
from typing import Dict, List, Optional

import pytest

from exo.download.shard_download import embedded_model_path
from exo.inference import llama_engine
from exo.inference.tokenizers import resolve_tokenizer
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.inference.sampling import SamplingParams
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.networking.grpc.grpc_server import GRPCServer
from exo.networking.manual.manual_discovery import ManualDiscovery
from exo.orchestration import statuses
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.plugin import register_batching
from exo.orchestration.generation import generate
from exo.orchestration.node import Node
from exo.orchestration.routing.route import Route
from exo.topology.placement import Stage
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.waiting import eventually
from tests.support.cluster import free_port, record_inference_states, write_manual_config
from tests.support.engines import cached_weights
from tests.support.models import smollm2_shard

pytestmark = pytest.mark.cluster

BASE = smollm2_shard(0, 0)
PROMPTS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in Spanish.",
           "Who wrote Hamlet?", "Write one sentence about the sea."]
TOKENS = 10


@pytest.fixture(autouse=True)
def shared_weights(monkeypatch):
  monkeypatch.setattr(llama_engine, "load_shard_weights", cached_weights)


@pytest.fixture(scope="module", autouse=True)
def weights_released():
  """The weights this module's nodes shared are read again by whoever needs them next (a suite runs in a few GiB)."""
  yield
  cached_weights.cache_clear()


async def start_node(node_id: str, port: int, config, downloader, placement: Optional[str] = "auto", batching: bool = True) -> Node:
  """A node as `exo` starts one: a manual-discovery ring member with its gRPC server; `placement` None: a node that
  does not follow routes and never announces (as an upstream node)."""
  node = Node(node_id, None, NumpyDynamicShardInferenceEngine(downloader), ManualDiscovery(str(config), node_id, GRPCPeerHandle, poll_interval=0.2),
              downloader, RingMemoryWeightedPartitioningStrategy(), max_generate_tokens=1000)
  node.server = GRPCServer(node, "127.0.0.1", port)
  if placement is not None:
    node.placements.enable(placement, 4, 50.0)  # equal speeds: the cut follows the weights alone
  if batching:
    register_batching(node, BatchingConfig(batch_size=8, timeout_ms=2, prefill_chunk=24))
  await node.start()
  return node


@contextlib.asynccontextmanager
async def ring(tmp_path, downloader, placements: Dict[str, Optional[str]]):
  ports = {name: free_port() for name in placements}
  config = write_manual_config(tmp_path / "peers.json", ports)
  nodes = {}
  try:
    for name, placement in placements.items():
      nodes[name] = await start_node(name, ports[name], config, downloader, placement)
    await eventually(lambda: all(len(n.peers) == len(nodes) - 1 for n in nodes.values()), 30)
    yield nodes
  finally:
    await asyncio.gather(*[n.stop() for n in nodes.values()])


@functools.lru_cache(maxsize=1)
def tokenizer():
  return resolve_tokenizer(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))


def template(text: str) -> str:
  return tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


async def answer(node: Node, text: str, tokens: int = TOKENS, with_ids: bool = True, out: Optional[List[int]] = None, **params) -> List[int]:
  prompt = template(text)
  ids = list(tokenizer().encode(prompt)) if with_ids else None
  out = [] if out is None else out
  async for delta, _ in generate(node, BASE, prompt, SamplingParams(max_tokens=tokens, **params), timeout=120, prompt_ids=ids):
    out += delta
  return out


@pytest.fixture(scope="module")
def references(smollm2_path):
  """Each prompt's greedy answer from one unbatched node alone."""
  from exo.download.shard_download import HFShardDownloader
  from exo.networking.discovery import NoDiscovery

  async def run():
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(llama_engine, "load_shard_weights", cached_weights)
      downloader = HFShardDownloader()
      node = Node("alone", None, NumpyDynamicShardInferenceEngine(downloader), NoDiscovery(), downloader, RingMemoryWeightedPartitioningStrategy())
      await node.start()
      try:
        await node.inference_engine.ensure_shard(smollm2_shard())
        return [await answer(node, p, with_ids=False) for p in PROMPTS]
      finally:
        await node.stop()
  return asyncio.run(run())


def groups_ready(node: Node, count: int) -> bool:
  view = node.placements.to_json([BASE])
  model = view.get("models", {}).get(BASE.model_id)
  return model is not None and len(model["groups"]) == count and all(model["ready"])


async def test_two_replicas_serve_one_burst_each_request_on_its_route(tmp_path, downloader, references):
  async with ring(tmp_path, downloader, {"rep-a": "auto", "rep-b": "auto"}) as nodes:
    a, b = nodes["rep-a"], nodes["rep-b"]
    await a.inference_engine.ensure_shard(smollm2_shard())  # the model in use: b loads its copy as soon as it hears
    await eventually(lambda: groups_ready(a, 2), 60)
    assert b.inference_engine.shard == smollm2_shard()  # a whole copy each, loaded before any request came to it
    assert a.placements.heard_all_peers() and b.placements.heard_all_peers()  # what `exo run --wait-for-peers` waits for
    sampled_on_b, rows_per_status, groups = set(), [], set()
    b.on_token.register("test").on_next(lambda request_id, tokens, finished: sampled_on_b.add(request_id))
    a.inbox.on_peer(statuses.TOKENS, lambda request_id, status, host: rows_per_status.append(len(status.rows)))
    # At each token a receives, what its state says of that request's group.
    a.on_token.register("groups").on_next(lambda request_id, tokens, finished: groups.update(
      r["group"] for r in a.state()["requests"] if r["id"] == request_id))
    answers = await asyncio.gather(*[answer(a, p) for p in PROMPTS])
    assert answers == references
    assert len(sampled_on_b) == len(PROMPTS) // 2  # a burst spreads at once: half of it went to b
    assert groups == {"rep-a", "rep-b"}  # /v1/state says which group each request is on
    assert max(rows_per_status) > 1  # b's steps sent a's tokens together, one message per step
    assert a.forwarding.router.routed["least_load"] + a.forwarding.router.routed["prefix"] == len(PROMPTS)


async def test_a_pipeline_cuts_layers_by_speed_with_the_head_counted(tmp_path, downloader, references):
  async with ring(tmp_path, downloader, {"pipe-a": "pipeline", "pipe-b": "pipeline"}) as nodes:
    a, b = nodes["pipe-a"], nodes["pipe-b"]
    await eventually(lambda: len(a.placements.placement(BASE).groups[0].stages) == 2 and len(b.placements.placement(BASE).groups[0].stages) == 2, 30)
    (group,) = a.placements.placement(BASE).groups
    assert [(s.node_id, s.start, s.end) for s in group.stages] == [("pipe-b", 0, 17), ("pipe-a", 18, 29)]
    await b.inference_engine.ensure_shard(smollm2_shard(0, 17))
    await eventually(lambda: groups_ready(a, 1), 60)
    packed = []
    for node in (a, b):
      process_tensor = node.process_tensor

      async def recording(base, tensor, request_id=None, state=None, accepted=None, process_tensor=process_tensor):
        if state and "rows" in state:
          packed.append(len(state["rows"]))
        return await process_tensor(base, tensor, request_id, state, accepted=accepted)
      node.process_tensor = recording
    # From the first stage (its tokens ride back on the tensors that feed them) and from the last.
    assert await asyncio.gather(*[answer(b, p) for p in PROMPTS[:3]]) == references[:3]
    assert await asyncio.gather(*[answer(a, p) for p in PROMPTS[3:]]) == references[3:]
    assert a.inference_engine.shard == smollm2_shard(18, 29) and b.inference_engine.shard == smollm2_shard(0, 17)
    assert packed and max(packed) > 1  # a step's rows went on to the next hop as one message


async def test_a_node_refuses_a_route_that_gives_it_layers_it_cannot_load_without_disturbing_its_requests(tmp_path, downloader, references):
  async with ring(tmp_path, downloader, {"ref-a": "auto", "ref-b": "auto"}) as nodes:
    a, b = nodes["ref-a"], nodes["ref-b"]
    await a.inference_engine.ensure_shard(smollm2_shard())
    await eventually(lambda: groups_ready(a, 2), 60)
    own: List[int] = []  # b serves a request of its own on its copy meanwhile
    running = asyncio.ensure_future(answer(b, PROMPTS[0], 1000, out=own, ignore_eos=True))
    await eventually(lambda: b.state()["kv_bytes"] > 0, 60)
    await a.lifecycle.start_request("odd", SamplingParams(max_tokens=4))
    request = a.requests.get("odd")
    a.forwarding.set_route(request, Route((Stage("ref-a", 0, 18), Stage("ref-b", 19, 29)), a.placements.placement(BASE).version, "ref-a"))
    events = a.lifecycle.watch("odd")
    await a.process_prompt(BASE, template(PROMPTS[1]), "odd")
    event = await asyncio.wait_for(events.get(), 60)
    assert event.error is not None and "ref-b cannot serve layers 19-29 of smollm2-135m" in event.error and "holds layers 0-29" in event.error
    await eventually(lambda: len(own) > TOKENS, 60)
    assert own[:len(references[0])] == references[0] and not running.done()  # its own request goes on undisturbed
    running.cancel()
    await eventually(lambda: not a.requests and not b.requests, 10)


async def test_a_ring_with_a_node_that_never_announces_runs_as_one_pipeline_over_every_node(tmp_path, downloader, references):
  async with ring(tmp_path, downloader, {"mix-a": "auto", "mix-b": None}) as nodes:
    a, b = nodes["mix-a"], nodes["mix-b"]
    a.placements.grace_s = 1.0
    states = record_inference_states(b)
    await eventually(lambda: not a.placements.active, 10)
    assert a.placements.to_json()["undeclared"] == ["mix-b"]
    assert a.placements.heard_all_peers()  # an upstream node, taken for one after the grace, is not waited for
    assert await asyncio.gather(*[answer(a, p) for p in PROMPTS[:3]]) == references[:3]
    # The layers every node derives from its own view, split by memory; nothing of routes on the wire.
    assert {a.inference_engine.shard, b.inference_engine.shard} == {a.get_current_shard(BASE), b.get_current_shard(BASE)}
    assert a.get_current_shard(BASE).get_layer_count() < 30 and states and all("route" not in s and "params" not in s for s in states)

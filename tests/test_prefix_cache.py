"""Prompt prefix reuse: the store's bookkeeping, then the real SmolLM2 on the numpy engine, where greedy answers with
the cache equal those without it, token for token: one node unbatched and batched (prompts in chunks), a shared
prefix that ends mid-block, a tiny budget beside a live request, a finished answer filed for the next turn (and a
cancelled one not), and a 2-node ring over real gRPC in this process (including a node that lacks the prefix, a node
that never announced the ability, as an upstream node, and answers filed on both nodes)."""
import argparse
import asyncio
import contextlib
import json
from typing import List

import numpy as np
import pytest

from exo.inference import llama_engine
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.inference.prefix_cache import BLOCK, MAX_ENTRIES, MAX_KEYS, PrefixStore, block_keys, checked_prefix
from exo.inference.sampling import SamplingParams
from exo.main import prefix_cache_budget
from exo.networking.discovery import NoDiscovery
from exo.networking.grpc.codec import decode_inference_state
from exo.networking.grpc.grpc_peer_handle import GRPCPeerHandle
from exo.networking.grpc.grpc_server import GRPCServer
from exo.networking.manual.manual_discovery import ManualDiscovery
from exo.orchestration import node as node_module
from exo.orchestration import statuses
from exo.orchestration.batching import scheduler as scheduler_module
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.plugin import register_batching
from exo.orchestration.generation import generate
from exo.orchestration.node import Node
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.api_server import eventually
from tests.support.cluster import free_port, wait_for_ring, write_manual_config
from tests.support.engines import cached_weights, check_prefix_copy_matches_computed, load_engine, load_engine_async
from tests.support.models import smollm2_shard

SYSTEM = "You are a careful assistant. You answer in one short sentence and never use lists. " * 3
QUESTIONS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
ANSWER_TOKENS = 8


# --- the store ---

class FakeCache:
  def __init__(self, nbytes: int, length: int = 0):
    self.nbytes, self.length = nbytes, length


def store_of(budget: int, live: List[FakeCache]) -> PrefixStore:
  return PrefixStore(budget, lambda: {id(c) for c in live}, lambda c: c.nbytes)


def test_block_keys_name_whole_prefixes():
  a, b = np.arange(3 * BLOCK + 5), np.concatenate([np.arange(2 * BLOCK), 1000 + np.arange(BLOCK)])
  keys_a, keys_b = block_keys("m", a), block_keys("m", b)
  assert len(keys_a) == 3 and len(keys_b) == 3  # only whole blocks
  assert keys_a[:2] == keys_b[:2] and keys_a[2] != keys_b[2]
  assert block_keys("other-model", a)[0] != keys_a[0]
  c = a.copy()
  c[0] = 7  # an earlier block changes every key after it
  assert all(x != y for x, y in zip(block_keys("m", c), keys_a))


def test_the_longest_held_prefix_is_found_and_an_extension_replaces_its_prefix():
  store, keys = store_of(1 << 20, []), [f"{i:024x}" for i in range(6)]
  short, long = FakeCache(10), FakeCache(20)
  store.add(short, keys[:2])
  assert store.longest(keys, 10 * BLOCK) == (store.entries[next(iter(store.entries))], 2 * BLOCK)
  store.add(long, keys[:5])
  assert [e.cache for e in store.entries.values()] == [long]  # the shorter one is part of it
  entry, positions = store.longest(keys, 3 * BLOCK + 1)  # a limit inside a block rounds down
  assert entry.cache is long and positions == 3 * BLOCK
  store.add(FakeCache(30), keys[:3])  # already held
  assert len(store.entries) == 1
  assert store.longest(keys[5:], 10 * BLOCK) == (None, 0)


def test_eviction_follows_use_and_never_touches_a_live_cache():
  live = [FakeCache(100)]
  store = store_of(150, live)
  a, b = FakeCache(100), FakeCache(100)
  store.add(live[0], ["0" * 24])
  store.add(a, ["a" * 24])
  store.add(b, ["b" * 24])  # over budget: a, least recently used, goes; the live one stays and costs nothing
  assert [e.cache for e in store.entries.values()] == [live[0], b]
  assert store.held_bytes() == 100
  store.set_budget(0)
  assert [e.cache for e in store.entries.values()] == [live[0]] and not store.enabled
  many = store_of(1 << 30, [])
  for i in range(MAX_ENTRIES + 5):
    many.add(FakeCache(1), [f"{i:024x}"])
  assert len(many.entries) == MAX_ENTRIES


def test_a_finished_request_extends_its_entry_and_a_taken_over_cache_keeps_only_the_shared_blocks():
  store, keys = store_of(1 << 20, []), [f"{i:024x}" for i in range(6)]
  cache = FakeCache(10, length=4 * BLOCK + 3)
  store.add(cache, keys[:2], "r1")
  store.extend("r1", keys[1:5], lambda c: c.length)  # not its prompt's blocks first: ignored
  store.extend("r2", keys[:5], lambda c: c.length)  # no entry of that request
  assert store.longest(keys, 10 * BLOCK)[1] == 2 * BLOCK
  store.extend("r1", keys, lambda c: c.length)  # its answer: as far as the cache holds whole blocks
  entry, positions = store.longest(keys, 10 * BLOCK)
  assert entry.cache is cache and positions == 4 * BLOCK and len(store.entries) == 1
  store.take_over(entry, 3 * BLOCK, "r3")  # r3 writes from position 48 on
  assert store.longest(keys, 10 * BLOCK) == (entry, 3 * BLOCK) and keys[3] not in store.by_key
  store.add(cache, keys[:3], "r3")  # r3's prompt is all held already, in the cache it took over: the entry is r3's
  store.extend("r3", keys[:5], lambda c: 5 * BLOCK)
  assert store.longest(keys, 10 * BLOCK)[1] == 5 * BLOCK and list(store.by_request) == ["r3"]


@pytest.mark.parametrize("bad", [None, [], {"keys": []}, {"keys": ["x"], "reuse": 0}, {"keys": ["0" * 24], "reuse": BLOCK + 1},
                                 {"keys": ["0" * 24], "reuse": 2 * BLOCK}, {"keys": ["0" * 24], "reuse": True},
                                 {"keys": ["0" * 24], "reuse": 0, "more": 1}])
def test_a_peers_unusable_prefix_is_refused(bad):
  with pytest.raises(ValueError, match="prefix"):
    checked_prefix(bad)


@pytest.mark.parametrize("bad", [{"keys": ["0" * 24]}, {"request_id": "r", "keys": "0" * 24}, {"request_id": "r", "keys": ["x"]},
                                 {"request_id": "r", "keys": ["0" * 24] * (MAX_KEYS + 1)}, {"request_id": "", "keys": ["0" * 24]}])
def test_a_peers_unusable_answer_blocks_are_refused(bad):
  assert statuses.parse(statuses.prefix_extend("r", ["0" * 24]))[1]["keys"] == ["0" * 24]
  with pytest.raises(statuses.InvalidStatus):
    statuses.parse(json.dumps({"type": statuses.PREFIX_EXTEND, **bad}))


def test_settings_on_by_default_a_budget_and_an_off_switch():
  args = lambda mb=None, off=False: argparse.Namespace(prefix_cache_mb=mb, no_prefix_cache=off)
  assert prefix_cache_budget(args(), {}) == 1 << 30
  assert prefix_cache_budget(args(), {"EXO_PREFIX_CACHE_MB": "64"}) == 64 << 20
  assert prefix_cache_budget(args(mb=8), {"EXO_PREFIX_CACHE_MB": "64"}) == 8 << 20
  assert prefix_cache_budget(args(), {"EXO_PREFIX_CACHE": "0"}) == 0
  assert prefix_cache_budget(args(off=True), {}) == 0
  for env in ({"EXO_PREFIX_CACHE_MB": "lots"}, {"EXO_PREFIX_CACHE_MB": "-1"}, {"EXO_PREFIX_CACHE": "maybe"}):
    with pytest.raises(ValueError, match="EXO_PREFIX_CACHE"):
      prefix_cache_budget(args(), env)


def test_only_the_prefix_travels_to_a_peer():
  assert decode_inference_state(GRPCPeerHandle._wire_state({"secret": 1})) == {}
  prefix = {"keys": ["0" * 24], "reuse": 0}
  assert decode_inference_state(GRPCPeerHandle._wire_state({"prefix": prefix, "secret": 1})) == {"prefix": prefix}


# --- SmolLM2, one node ---

@pytest.fixture(scope="module")
def engine(downloader):
  return load_engine(NumpyDynamicShardInferenceEngine, downloader)


async def test_a_copied_prefix_gives_the_logits_of_one_computed_whole(engine):
  await check_prefix_copy_matches_computed(engine)


async def test_a_prefix_start_loads_its_shard_first(downloader, monkeypatch):
  """A request's first message at a node after the first starts from a prefix before any step: on a node whose
  engine still held another shard, it used to fail ("the engine now holds ...") instead of loading its own."""
  monkeypatch.setattr(llama_engine, "load_shard_weights", cached_weights)
  other = await load_engine_async(NumpyDynamicShardInferenceEngine, downloader, smollm2_shard(15))
  wanted = smollm2_shard(0, 14)
  assert await other.start_from_prefix("first-message", wanted, block_keys(wanted.model_id, np.arange(2 * BLOCK)[None]), BLOCK) == 0
  assert other.shard == wanted and "first-message" not in other.caches


@contextlib.contextmanager
def prefixes_off(*engines):
  for e in engines:
    e.prefixes.enabled = False
  try:
    yield
  finally:
    for e in engines:
      e.prefixes.enabled = True


async def answer(node: Node, prompt: str, max_tokens: int = ANSWER_TOKENS, ignore_eos: bool = False) -> List[int]:
  out = []
  params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
  async for tokens, _ in generate(node, smollm2_shard(), prompt, params, timeout=120):
    out += tokens
  return out


def conversation(engine, turns: int) -> List[str]:
  """The prompt of each turn of one chat; each turn's answer is a fixed text, so every prompt extends the one before."""
  messages, prompts = [{"role": "system", "content": SYSTEM}], []
  for question in QUESTIONS[:turns]:
    messages.append({"role": "user", "content": question})
    prompts.append(engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    messages.append({"role": "assistant", "content": "I would say it depends on how you count."})
  return prompts


async def one_node(engine, batching: bool) -> Node:
  engine.prefixes.clear()  # nothing from an earlier test
  node = Node("prefix-node", None, engine, NoDiscovery(), engine.shard_downloader, partitioning_strategy=RingMemoryWeightedPartitioningStrategy())
  if batching:
    register_batching(node, BatchingConfig(batch_size=8, timeout_ms=2, prefill_chunk=24))
  await node.start()
  return node


@pytest.mark.parametrize("batching", [False, True], ids=["unbatched", "batched"])
async def test_a_chat_answers_the_same_with_its_earlier_turns_cached(engine, batching, monkeypatch):
  # Prompts run in chunks of 40 tokens, unbatched and batched: chunk edges fall inside blocks and inside the prefix.
  monkeypatch.setattr(node_module, "PROMPT_CHUNK", 40)
  monkeypatch.setattr(scheduler_module, "LONE_PROMPT_CHUNK", 40)
  node = await one_node(engine, batching)
  try:
    prompts = conversation(engine, 3)
    with prefixes_off(engine):
      references = [await answer(node, p) for p in prompts]
    hits, reused = engine.prefixes.hits, engine.prefixes.reused_positions
    cached = [await answer(node, p) for p in prompts]
    assert cached == references
    assert engine.prefixes.hits - hits == 2  # turns 2 and 3 start from the turn before
    assert engine.prefixes.reused_positions - reused >= len(engine.tokenizer.encode(prompts[0])) // BLOCK * BLOCK
    # Users sharing the system prompt, at once: each starts from it, and answers as alone.
    questions = [prompts[0].replace("France", country) for country in ("Spain", "Peru", "Japan")]
    with prefixes_off(engine):
      alone = [await answer(node, q) for q in questions]
    hits = engine.prefixes.hits
    assert list(await asyncio.gather(*[answer(node, q) for q in questions])) == alone
    assert engine.prefixes.hits - hits == 3
    await eventually(lambda: node.state()["kv_bytes"] == 0, 10)  # caches are freed just after each end
    assert 0 < node.state()["prefix_cache"]["bytes"] <= engine.prefixes.budget_bytes
  finally:
    await node.stop()


async def test_a_prefix_that_ends_mid_block_reuses_the_whole_blocks_before_it(engine):
  node = await one_node(engine, batching=False)
  try:
    base = engine.tokenizer.encode(SYSTEM)
    cut = 3 * BLOCK + 7  # the two prompts share 55 tokens: three whole blocks and part of the fourth
    first = engine.tokenizer.decode(base[:cut] + engine.tokenizer.encode(" Then tell me about the moon."))
    second = engine.tokenizer.decode(base[:cut] + engine.tokenizer.encode(" Rather, describe the sea at night."))
    ids_first, ids_second = engine.tokenizer.encode(first), engine.tokenizer.encode(second)
    shared = next(i for i, (x, y) in enumerate(zip(ids_first, ids_second)) if x != y)
    assert shared % BLOCK and shared > BLOCK
    with prefixes_off(engine):
      reference = await answer(node, second)
    await answer(node, first)
    reused = engine.prefixes.reused_positions
    assert await answer(node, second) == reference
    assert engine.prefixes.reused_positions - reused == shared // BLOCK * BLOCK
  finally:
    await node.stop()


async def test_a_tiny_budget_evicts_ended_prompts_and_never_a_live_requests_cache(engine):
  node = await one_node(engine, batching=True)
  engine.prefixes.set_budget(1)
  try:
    long_prompt, short_prompt = conversation(engine, 2)[1], conversation(engine, 1)[0]
    with prefixes_off(engine):
      reference = await answer(node, long_prompt, 64, ignore_eos=True)
    # While the long answer streams, other prompts come and go; its cache is filed, and must stay filed and intact.
    long_task = asyncio.ensure_future(answer(node, long_prompt, 64, ignore_eos=True))
    await eventually(lambda: any(r.tokens for r in node.requests), 60)
    (live_cache,) = engine.caches.values()
    for _ in range(2):
      await answer(node, short_prompt, 2)
    assert not long_task.done(), "the long answer must still be running here"
    assert [e.cache for e in engine.prefixes.entries.values()] == [live_cache]
    assert await long_task == reference
    await eventually(lambda: node.state()["prefix_cache"]["bytes"] == 0 and not engine.caches, 10)
    assert not engine.prefixes.entries  # once ended, nothing fits a budget of one byte
  finally:
    engine.prefixes.set_budget(1 << 30)
    await node.stop()


def template(engine, messages) -> str:
  return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


async def two_turns(engine, node: Node, first_answer_tokens: int) -> tuple:
  """A chat's first turn, answered by the model, and the second turn's prompt, which holds that answer."""
  messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Describe a walk along a river at dawn."}]
  first = template(engine, messages)
  first_answer = await answer(node, first, first_answer_tokens, ignore_eos=True)
  messages += [{"role": "assistant", "content": engine.tokenizer.decode(first_answer)}, {"role": "user", "content": QUESTIONS[1]}]
  return first, first_answer, template(engine, messages)


@pytest.mark.parametrize("batching", [False, True], ids=["unbatched", "batched"])
async def test_a_finished_answer_is_filed_and_the_next_turn_reuses_it(engine, batching):
  node = await one_node(engine, batching)
  try:
    first, first_answer, second = await two_turns(engine, node, 2 * BLOCK + 1)  # 2 * BLOCK of it fed back
    prompt_tokens, second_ids = len(engine.tokenizer.encode(first)), engine.tokenizer.encode(second)
    assert second_ids[:prompt_tokens + 2 * BLOCK] == engine.tokenizer.encode(first) + first_answer[:2 * BLOCK]  # re-rendered alike
    with prefixes_off(engine):
      reference = await answer(node, second)
    reused = engine.prefixes.reused_positions
    assert await answer(node, second) == reference
    # Every whole block the first turn's cache held, its answer's included: past the first prompt.
    assert engine.prefixes.reused_positions - reused == (prompt_tokens + 2 * BLOCK) // BLOCK * BLOCK > prompt_tokens
  finally:
    await node.stop()


async def test_a_cancelled_answer_files_nothing_past_its_prompt(engine):
  node = await one_node(engine, batching=False)
  try:
    prompt = template(engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Describe a walk along a river at dawn."}])
    prompt_tokens, got = len(engine.tokenizer.encode(prompt)), []
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    async with contextlib.aclosing(generate(node, smollm2_shard(), prompt, params, timeout=120)) as tokens:
      async for new, _ in tokens:
        got += new
        if len(got) > 2 * BLOCK:
          break  # the client leaves: the request is cancelled
    await eventually(lambda: not node.requests and not engine.caches and not node._tasks, 10)
    await engine._run(lambda: None)  # anything queued on the engine's thread has run
    (entry,) = engine.prefixes.entries.values()
    assert len(entry.keys) == prompt_tokens // BLOCK and entry.cache.length > prompt_tokens + 2 * BLOCK
  finally:
    await node.stop()


# --- SmolLM2 over a 2-node ring, real gRPC in this process ---

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
    received = []
    process_tensor = second.process_tensor

    async def recording(base_shard, tensor, request_id=None, inference_state=None, accepted=None):
      received.append(dict(inference_state or {}))
      return await process_tensor(base_shard, tensor, request_id, inference_state, accepted=accepted)
    second.process_tensor = recording
    prompts = conversation(engine, 2)

    # A node that never announced the ability (as an upstream node): the first node reuses nothing and sends no state.
    second.inference_engine.prefixes.enabled = False
    first.peer_prefix_blocks.clear()
    references = [await answer(first, p) for p in prompts]
    assert [await answer(first, p) for p in prompts] == references
    assert first.inference_engine.prefixes.hits == 0 and all(state == {} for state in received)

    # Every node announces: the second turn starts from the first on both nodes, with the same answer.
    second.inference_engine.prefixes.enabled = True
    await second.announce_prefix_cache()
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
    await eventually(lambda: not first.prefix_protocol.filings, 10)  # the answer's blocks are on their way into both stores
    with prefixes_off(*engines):
      reference = await answer(first, next_prompt)
    await second.announce_prefix_cache()  # it may have announced its cache off meanwhile
    await eventually(lambda: first.peer_prefix_blocks.get(second.id) == BLOCK, 10)
    before = [e.prefixes.reused_positions for e in engines]
    assert await answer(first, next_prompt) == reference
    held = (len(engine.tokenizer.encode(prompt)) + 2 * BLOCK) // BLOCK * BLOCK  # the first turn's answer included
    assert [e.prefixes.reused_positions - b for e, b in zip(engines, before)] == [held, held]

"""Prompt prefix reuse on the real SmolLM2 (numpy engine), one node: greedy answers with the cache equal those without
it, token for token, unbatched and batched (prompts in chunks), a shared prefix that ends mid-block, a tiny budget
beside a live request, a finished answer filed for the next turn (and a cancelled one not). (The bookkeeping alone:
test_prefix_store.py; over a 2-node ring: test_prefix_ring.py.)"""
import asyncio
import contextlib

import numpy as np
import pytest

from exo.inference import llama_engine
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.inference.prefix_cache import BLOCK, block_keys
from exo.inference.sampling import SamplingParams
from exo.networking.discovery import NoDiscovery
from exo.orchestration.steps import scheduler as scheduler_module
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.plugin import register_batching
from exo.orchestration.generation import generate
from exo.orchestration.node import Node
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.engines import cached_weights, check_prefix_copy_matches_computed, load_engine, load_engine_async
from tests.support.models import smollm2_shard
from tests.support.prefixes import SYSTEM, answer, conversation, prefixes_off, template, two_turns
from tests.support.waiting import eventually

pytestmark = pytest.mark.model


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
    await eventually(lambda: any(r.sampling and r.sampling.tokens for r in node.requests), 60)
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
    # Its cache is freed on the engine's thread after its prompt's blocks were filed there: nothing is left to run.
    await eventually(lambda: not node.requests and not engine.caches and node.pending()["tasks"] == 0, 10)
    (entry,) = engine.prefixes.entries.values()
    # (Its cache holds the tokens fed back before the client left; the last one's pass may or may not have begun.)
    assert len(entry.keys) == prompt_tokens // BLOCK and entry.cache.length >= prompt_tokens + 2 * BLOCK
  finally:
    await node.stop()

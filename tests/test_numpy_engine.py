"""The numpy engine on the real SmolLM2-135M: answers, KV-cache correctness, sharding, isolation, memory."""
import asyncio
import mmap
from pathlib import Path

import numpy as np
import pytest

from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.inference.numpy.llama import Llama
from exo.inference.weights import load_shard_weights
from tests.support.models import smollm2_shard

# Logits of the same forward computed two ways (cached vs recomputed, one shard vs two) agree to this absolute
# tolerance; float32 summation order differs between the ways, the logits themselves are O(10).
LOGIT_ATOL = 2e-3


@pytest.fixture(scope="module")
def engine(downloader):
  eng = NumpyDynamicShardInferenceEngine(downloader)
  asyncio.run(eng.ensure_shard(smollm2_shard()))
  return eng


@pytest.fixture(scope="module")
def full_weights(smollm2_path):
  return load_shard_weights(smollm2_path, smollm2_shard())


def chat(engine, text):
  return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


async def greedy(engine, request_id, prompt, n):
  shard = smollm2_shard()
  logits, _ = await engine.infer_prompt(request_id, shard, prompt)
  tokens = []
  for _ in range(n):
    token = int(np.argmax(logits[0, -1]))
    tokens.append(token)
    if token in engine.tokenizer.eos_token_ids:
      break
    await asyncio.sleep(0)  # run concurrently, requests take turns token by token
    logits, _ = await engine.infer_tensor(request_id, shard, np.array([[token]]))
  await engine.finish_request(request_id)
  return tokens


@pytest.mark.parametrize("question, expected", [
  ("What is the capital of France?", "The capital of France is Paris."),
  ("What is 2 + 2?", "The answer to this classic math problem is 4."),
])
async def test_greedy_answers(engine, question, expected):
  tokens = await greedy(engine, f"q-{question}", chat(engine, question), 24)
  assert engine.tokenizer.decode(tokens).startswith(expected)


async def test_output_shapes(engine):
  logits, state = await engine.infer_prompt("shapes", smollm2_shard(), "Hello there")
  assert logits.shape == (1, 1, 49152) and logits.dtype == np.float32
  assert state is None
  await engine.finish_request("shapes")


def test_kv_cache_matches_full_recomputation(full_weights):
  config, weights = full_weights
  model = Llama(config, smollm2_shard(), weights)
  ids = np.array([1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198, 504, 3575])
  cache = model.new_cache()
  incremental = [model.forward([ids[:10]], [cache])[0]]
  for i in range(10, len(ids)):
    incremental.append(model.forward([ids[i:i + 1]], [cache])[0])
  for i, logits in enumerate(incremental):
    full = model.forward([ids[:10 + i]], [model.new_cache()])[0]
    np.testing.assert_allclose(logits, full, atol=LOGIT_ATOL)


def test_two_shards_equal_whole_model(full_weights, smollm2_path):
  config, weights = full_weights
  ids = np.array([1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47])
  whole_model = Llama(config, smollm2_shard(), weights)
  whole = whole_model.forward([ids], [whole_model.new_cache()])[0]
  first = Llama(config, smollm2_shard(0, 11), load_shard_weights(smollm2_path, smollm2_shard(0, 11))[1])
  second_weights = load_shard_weights(smollm2_path, smollm2_shard(12, 29))[1]
  assert not any(k.startswith("model.layers.0.") for k in second_weights), "a shard loads only its own layers"
  second = Llama(config, smollm2_shard(12, 29), second_weights)
  hidden = first.forward([ids], [first.new_cache()])[0]
  assert hidden.shape == (len(ids), config.hidden_size)
  split = second.forward([hidden], [second.new_cache()])[0]
  np.testing.assert_allclose(split, whole, atol=LOGIT_ATOL)


async def test_interleaved_requests_match_alone(engine):
  questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello.",
               "What is the largest planet?", "Who wrote Hamlet?", "What is water made of?", "Count to three."]
  prompts = [chat(engine, q) for q in questions]
  n = 12
  alone = [await greedy(engine, f"alone-{i}", p, n) for i, p in enumerate(prompts)]

  mixed = await asyncio.gather(*[greedy(engine, f"mixed-{i}", p, n) for i, p in enumerate(prompts)])
  assert mixed == alone


async def test_kv_cache_memory_returns_to_zero(engine):
  shard = smollm2_shard()
  for i in range(3):
    await engine.infer_prompt(f"mem-{i}", shard, "Hello " * (i + 1))
  assert engine.kv_cache_bytes() > 0
  for i in range(3):
    await engine.finish_request(f"mem-{i}")
  assert engine.kv_cache_bytes() == 0


def resident_bytes() -> int:
  return int(Path("/proc/self/statm").read_text().split()[1]) * mmap.PAGESIZE


async def test_cache_memory_grows_with_use_not_with_its_reserved_room(engine):
  shard = smollm2_shard()
  await engine.infer_prompt("grow", shard, "Hi")
  cache = engine.caches["grow"]
  small = cache.nbytes
  assert 0 < small < cache.data.nbytes / 16
  await engine.infer_prompt("grow", shard, "word " * 100)
  assert cache.nbytes > small
  await engine.finish_request("grow")

  before = resident_bytes()
  caches = [engine.model.new_cache() for _ in range(40)]  # 40 x 1024 positions of room: 1.9 GB of address space
  assert sum(c.data.nbytes for c in caches) > 1.5e9
  assert resident_bytes() - before < 100e6  # only what is written takes memory


async def test_bad_inputs_are_clear_errors(engine):
  shard = smollm2_shard()
  with pytest.raises(ValueError, match="out of range"):
    await engine.infer_tensor("bad", shard, np.array([[10**6]]))
  with pytest.raises(ValueError, match="token ids"):
    await engine.infer_tensor("bad", shard, np.zeros((1, 2, 576), dtype=np.float32))
  assert "bad" not in engine.caches


def test_a_product_split_over_the_cores_equals_it_on_one_thread():
  from exo.inference.numpy import llama
  rng = np.random.default_rng(0)
  blocks = llama.block_weight(rng.standard_normal((96, 200), dtype=np.float32))  # 7 blocks: uneven slices
  for rows in (1, llama.PARALLEL_ROWS - 1, llama.PARALLEL_ROWS, 40):
    x = rng.standard_normal((rows, 96), dtype=np.float32)
    alone = np.empty((rows, blocks.shape[0] * llama.BLOCK), dtype=np.float32)
    for b in range(blocks.shape[0]):
      alone[:, b * llama.BLOCK:(b + 1) * llama.BLOCK] = x @ blocks[b]
    assert np.array_equal(llama.matmul(x, blocks, 200), alone[:, :200])


def test_split_work_reports_a_workers_error_and_serves_concurrent_callers():
  from concurrent.futures import ThreadPoolExecutor
  from exo.inference.numpy import llama
  if not llama._workers:
    pytest.skip("one core: nothing is split")

  def fails_in_a_worker(lo, hi):
    if lo > 0:
      raise ValueError("bad slice")
  with pytest.raises(ValueError, match="bad slice"):
    llama.split_over_cores(fails_in_a_worker, 10)
  seen = []
  llama.split_over_cores(lambda lo, hi: seen.append((lo, hi)), 10)  # the workers still serve after an error
  assert sorted(seen)[0][0] == 0 and sorted(seen)[-1][1] == 10 and sum(hi - lo for lo, hi in seen) == 10

  rng = np.random.default_rng(1)
  blocks = llama.block_weight(rng.standard_normal((64, 256), dtype=np.float32))
  xs = [rng.standard_normal((16, 64), dtype=np.float32) for _ in range(4)]
  expected = [llama.matmul(x, blocks, 256) for x in xs]
  with ThreadPoolExecutor(4) as pool:  # several engines' threads at once: each gets its own product back
    for _ in range(50):
      assert all(np.array_equal(got, want) for got, want in zip(pool.map(lambda x: llama.matmul(x, blocks, 256), xs), expected))


async def test_a_step_shared_among_the_cores_matches_each_request_alone(engine, monkeypatch):
  from exo.inference.numpy import llama
  from tests.support.engines import OPENINGS, batched, greedy, prompt_ids
  prompts = prompt_ids(engine, OPENINGS + [f"{opening} (again)" for opening in OPENINGS])  # 16: decode steps of 16 rows
  alone = [await greedy(engine, f"alone-{i}", ids, 6, stop_at_eos=False) for i, ids in enumerate(prompts)]
  shared, original = [], llama.balanced_groups
  monkeypatch.setattr(llama, "balanced_groups", lambda lengths, parts: shared.append(original(lengths, parts)) or shared[-1])
  assert await batched(engine, prompts, 6, "cores", join_every=0, stop_at_eos=False) == alone
  if llama.CORES > 1:
    assert len(shared) == 6 and all(len(groups) == llama.CORES for groups in shared[1:]), "each decode step was shared among the cores"
  assert engine.kv_cache_bytes() == 0


def test_rows_are_shared_evenly_or_not_at_all():
  from exo.inference.numpy.llama import balanced_groups
  assert balanced_groups([1] * 16, 2) == [(0, 8), (8, 16)]
  assert balanced_groups([1] * 17, 2) == [(0, 9), (9, 17)]
  assert balanced_groups([64] * 8, 2) == [(0, 4), (4, 8)]
  assert balanced_groups([1] * 15, 2) == [(0, 15)]  # too few rows: the products are split instead
  assert balanced_groups([512] + [1] * 7, 2) == [(0, 8)]  # one prompt is most of the step
  assert balanced_groups([1] * 16, 1) == [(0, 16)]


def test_a_forked_child_still_splits_its_products():
  import os
  import time
  from exo.inference.numpy import llama
  if not hasattr(os, "fork") or not llama._workers:
    pytest.skip("no fork, or one core: nothing is split")
  rng = np.random.default_rng(2)
  blocks = llama.block_weight(rng.standard_normal((64, 256), dtype=np.float32))
  x = rng.standard_normal((16, 64), dtype=np.float32)
  expected = llama.matmul(x, blocks, 256)
  child = os.fork()
  if child == 0:  # the parent's workers do not exist here: without new ones this product would wait forever
    try:
      os._exit(0 if np.array_equal(llama.matmul(x, blocks, 256), expected) else 1)
    finally:
      os._exit(2)
  deadline = time.monotonic() + 30
  while True:
    done, status = os.waitpid(child, os.WNOHANG)
    if done:
      break
    if time.monotonic() > deadline:
      os.kill(child, 9)
      os.waitpid(child, 0)
      pytest.fail("the forked child's split product never finished")
    time.sleep(0.05)
  assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0

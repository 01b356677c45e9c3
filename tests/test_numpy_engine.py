"""The numpy engine on the real SmolLM2-135M: answers, KV-cache correctness, sharding, isolation, memory, and its
kernels (the products shared among the cores, the KV pool, attention jobs shared among the cores)."""
import asyncio
import gc
import mmap
import weakref
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


def pool_resident_bytes(pool) -> int:
  """Resident bytes of the pool's own mappings (from /proc/self/smaps): the process's total moves with whatever else
  it frees or allocates meanwhile."""
  starts = {slab.ctypes.data for slab in pool.slabs}
  total, counting = 0, False
  for line in Path("/proc/self/smaps").read_text().splitlines():
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
      counting = int(head.split("-")[0], 16) in starts
    elif counting and head == "Rss:":
      total += int(line.split()[1]) * 1024
  return total


async def test_cache_memory_grows_with_use_and_returns_when_requests_end(engine):
  shard = smollm2_shard()
  await engine.infer_prompt("grow", shard, "Hi")
  small = engine.request_kv_bytes("grow")
  assert 0 < small < engine.caches["grow"].pool.slot_bytes / 64
  await engine.infer_prompt("grow", shard, "word " * 100)
  assert engine.request_kv_bytes("grow") > small and engine.kv_cache_bytes() == engine.request_kv_bytes("grow")
  await engine.finish_request("grow")
  assert engine.request_kv_bytes("grow") == 0 and engine.kv_cache_bytes() == 0

  model = engine.model
  caches = [model.new_cache() for _ in range(40)]  # room for 40 whole contexts: 15 GB of address space
  assert len({c.slot for c in caches}) == 40 and model.pool.slot_bytes * 40 > 10e9
  assert pool_resident_bytes(model.pool) < 1e6  # only what is written takes memory
  ids = np.array(engine.tokenizer.encode("word " * 300), dtype=np.int64)[:256]
  model.forward([ids] * 8, caches[:8])
  written = pool_resident_bytes(model.pool)
  assert written >= sum(c.nbytes for c in caches[:8]) > 0
  del caches
  assert pool_resident_bytes(model.pool) < written / 4, "a finished request's pages go back to the kernel"
  assert model.new_cache().slot == 0, "the lowest free slot is taken first"


def test_cache_pool_slots_are_counted_and_reused():
  from exo.inference.numpy.cache import SLAB_SLOTS, KVCache, KVPool
  pool = KVPool(n_layers=2, n_kv_heads=1, head_dim=8, positions=100)
  assert pool.positions == 1024
  caches = [KVCache(pool) for _ in range(SLAB_SLOTS + 2)]
  assert [c.slot for c in caches] == list(range(SLAB_SLOTS + 2)) and len(pool.slabs) == 2
  caches[3].data[:] = 1.0
  pool.retain(3)  # another reader of slot 3 keeps it when its request ends
  del caches[3]
  assert KVCache(pool).slot == SLAB_SLOTS + 2
  assert (pool.where(3)[0][3] == 1.0).all()
  pool.release(3)
  fresh = KVCache(pool)
  assert fresh.slot == 3 and not fresh.data.any(), "a released slot reads as zeros"


def test_the_cores_keep_nothing_of_the_last_task_they_ran():
  """A step's tasks are closures over the model: a worker that kept its last one would keep a model its engine has
  let go (switching from SmolLM2 to another model left SmolLM2's 540 MB resident)."""
  from exo.inference.numpy import kernels
  if kernels.CORES < 2:
    pytest.skip("one core: no worker threads")

  class Model:
    pass
  model, failing = Model(), Model()
  seen = []

  def part(a: int, b: int, model=model) -> None:
    seen.append((a, b))

  def fails(a: int, b: int, model=failing) -> None:
    raise ValueError("a slice failed")
  kernels.split_over_cores(part, 2)
  with pytest.raises(ValueError):
    kernels.split_over_cores(fails, 2)
  assert sorted(seen) == [(0, 1), (1, 2)]
  gone = [weakref.ref(model), weakref.ref(failing)]
  del model, failing, part, fails
  gc.collect()
  assert [ref() for ref in gone] == [None, None]


def test_a_product_split_over_the_cores_equals_it_on_one_thread():
  from exo.inference.numpy import kernels
  rng = np.random.default_rng(0)
  w = rng.standard_normal((96, 200), dtype=np.float32)  # 200 columns: uneven slices
  for rows in (1, kernels.PARALLEL_ROWS - 1, kernels.PARALLEL_ROWS, 40):
    x = rng.standard_normal((rows, 96), dtype=np.float32)
    np.testing.assert_allclose(kernels.matmul(x, w), x @ w, rtol=1e-6, atol=1e-5)


def test_split_work_reports_a_workers_error_and_serves_concurrent_callers():
  from concurrent.futures import ThreadPoolExecutor
  from exo.inference.numpy import kernels
  if kernels.CORES < 2:
    pytest.skip("one core: nothing is split")

  def fails_in_a_worker(lo, hi):
    if lo > 0:
      raise ValueError("bad slice")
  with pytest.raises(ValueError, match="bad slice"):
    kernels.split_over_cores(fails_in_a_worker, 10)
  seen = []
  kernels.split_over_cores(lambda lo, hi: seen.append((lo, hi)), 10)  # the workers still serve after an error
  assert sorted(seen)[0][0] == 0 and sorted(seen)[-1][1] == 10 and sum(hi - lo for lo, hi in seen) == 10

  rng = np.random.default_rng(1)
  w = rng.standard_normal((64, 256), dtype=np.float32)
  xs = [rng.standard_normal((16, 64), dtype=np.float32) for _ in range(4)]
  expected = [kernels.matmul(x, w) for x in xs]
  with ThreadPoolExecutor(4) as pool:  # several engines' threads at once: each gets its own product back
    for _ in range(50):
      for got, want in zip(pool.map(lambda x: kernels.matmul(x, w), xs), expected):  # alone or split: the rounding may differ
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_workers_start_on_first_use_not_at_import():
  import subprocess
  import sys
  code = ("import threading, numpy as np; from exo.inference.numpy import kernels, llama; n = threading.active_count(); "
          "kernels.matmul(np.ones((8, 8), np.float32), np.ones((8, 128), np.float32)); "
          "print(n, threading.active_count(), kernels.CORES)")
  output = subprocess.check_output([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, text=True)
  before, after, cores = map(int, output.split())
  assert before == 1 and after == cores, "one worker per extra core, started by the first product that needs them"


def test_attention_jobs_are_shared_evenly_and_runs_follow_consecutive_slots():
  from exo.inference.numpy import attention
  from exo.inference.numpy.cache import KVCache, KVPool
  pool = KVPool(n_layers=1, n_kv_heads=1, head_dim=8, positions=2048)
  caches = [KVCache(pool) for _ in range(20)]
  for cache in caches:
    cache.length = 100
  jobs = lambda step: [job for group in step.job_groups for job in group]
  slots = lambda job: list(range(job.slot, job.slot + len(job.ends)))
  decode = attention.Step(pool, caches[:16], [1] * 16)
  assert all(isinstance(job, attention.DecodeRun) for job in jobs(decode)) and sum(map(slots, jobs(decode)), []) == list(range(16))
  if attention.CORES > 1:
    assert len(decode.job_groups) == attention.CORES and {sum(len(j.ends) for j in g) for g in decode.job_groups} == {16 // attention.CORES}
  assert [slots(job) for job in attention.share(jobs(attention.Step(pool, [caches[i] for i in (0, 1, 2, 5, 6, 9)], [1] * 6)), 1)[0]] == \
    [[0, 1, 2], [5, 6], [9]], "one run per stretch of consecutive slots"
  caches[3].length = 1000  # far longer than its neighbours: padding them all to it would waste most of the run
  assert len(jobs(attention.Step(pool, caches[:8], [1] * 8))) >= 3
  prompt = jobs(attention.Step(pool, caches[:4], [1, 30, 1, 1]))
  chunks = [job for job in prompt if isinstance(job, attention.PromptChunk)]
  assert {job.slot for job in chunks} == {1} and sum(job.n for job in chunks) == 30, "a prompt chunk attends on its own (the cores may share its rows)"
  assert sum((slots(job) for job in prompt if isinstance(job, attention.DecodeRun)), []) == [0, 2, 3]
  costs = [sum(job.cost for job in group) for group in attention.share(jobs(attention.Step(pool, caches[4:20], [1] * 16)), 2)]
  assert len(costs) == 2 and max(costs) <= 1.1 * min(costs), "the cores read about as many cached positions each"
  fresh = [job for group in attention.share([attention.PromptChunk(*pool.where(KVCache(pool).slot), 0, 0, 512)], 2) for job in group]
  assert [job.n for job in fresh] == [362, 150], "a fresh prompt's later rows see more positions: it is cut where both halves see as many"
  assert abs(fresh[0].seen(fresh[0].n) - fresh[1].seen(fresh[1].n)) < 0.01 * fresh[0].seen(fresh[0].n)


@pytest.mark.parametrize("scale", [0.05, 3.0, -3.0])
def test_attention_equals_a_float64_softmax_whatever_the_scores(scale):
  """Attention takes exp(score) unshifted while that is exact and shifts by each row's max otherwise. Scores of
  +-190 (every key along the query's direction) overflow exp, or make every weight of a row underflow, unshifted:
  decode runs and prompt chunks (a long cached prefix, rows in several tiles, a causal part) still equal a float64
  softmax over each row's own positions."""
  from exo.inference.numpy import attention
  from exo.inference.numpy.cache import KVCache, KVPool
  n_kv, group, hd = 2, 3, 64
  rng = np.random.default_rng(1)
  pool = KVPool(n_layers=1, n_kv_heads=n_kv, head_dim=hd, positions=1024)
  caches = [KVCache(pool) for _ in range(3)]  # the decode rows read slots 0-2, the prompt chunk slot 1
  direction = np.ones(hd, dtype=np.float32)
  for cache in caches:
    cache.data[0, 0] = direction + 0.2 * rng.standard_normal((n_kv, pool.positions, hd), dtype=np.float32)
    cache.data[0, 1] = rng.standard_normal((n_kv, pool.positions, hd), dtype=np.float32)
  rows, start, n = 3 + 150, 200, 150  # three decode rows, then a prompt chunk of 150 rows after 200 cached positions
  q = (scale * direction + rng.standard_normal((rows, n_kv * group, hd), dtype=np.float32)).astype(np.float32)
  ends = np.array([300, 260, 280])  # positions each decode row sees
  attn = np.zeros((rows, n_kv * group * hd), dtype=np.float32)
  slab, first_slot = pool.where(caches[0].slot)
  attention.DecodeRun(slab, first_slot, 0, ends).attend(0, q, attn, n_kv)
  attention.PromptChunk(*pool.where(caches[1].slot), 3, start, n).attend(0, q, attn, n_kv)

  def expected(cache, row, seen):
    keys, values = cache.data[0, 0].astype(np.float64), cache.data[0, 1].astype(np.float64)
    out = []
    for head in range(n_kv * group):
      scores = keys[head // group, :seen] @ q[row, head]
      weights = np.exp(scores - scores.max())
      out.append(weights @ values[head // group, :seen] / weights.sum())
    return np.concatenate(out)
  for row in range(rows):
    want = expected(caches[row], row, ends[row]) if row < 3 else expected(caches[1], row, start + row - 3 + 1)
    np.testing.assert_allclose(attn[row], want, rtol=0, atol=1e-4, err_msg=f"row {row}")


async def test_a_step_shared_among_the_cores_matches_each_request_alone(engine, monkeypatch):
  from exo.inference.numpy import attention, llama
  from tests.support.engines import OPENINGS, batched, greedy, prompt_ids
  prompts = prompt_ids(engine, OPENINGS + [f"{opening} (again)" for opening in OPENINGS])  # 16: decode steps of 16 rows
  alone = [await greedy(engine, f"alone-{i}", ids, 6, stop_at_eos=False) for i, ids in enumerate(prompts)]
  steps, original = [], llama.Step
  monkeypatch.setattr(llama, "Step", lambda *args: steps.append(original(*args)) or steps[-1])
  assert await batched(engine, prompts, 6, "cores", join_every=0, stop_at_eos=False) == alone
  if attention.CORES > 1:
    assert len(steps) == 6 and all(len(step.job_groups) == attention.CORES for step in steps), "each step's attention was shared among the cores"
  assert engine.kv_cache_bytes() == 0


async def test_a_request_past_the_context_is_refused_alone(engine):
  shard = smollm2_shard()
  context = engine.model.config.max_position_embeddings
  results = await engine.infer_batch(shard, [("long", np.ones((1, context + 1), dtype=np.int64), None), ("short", np.array([[42]]), None)])
  assert isinstance(results[0], ValueError) and "context" in str(results[0])
  assert results[1][0].shape == (1, 1, 49152) and "long" not in engine.caches
  await engine.finish_request("short")


def test_a_forked_child_still_splits_its_products():
  import os
  import time
  from exo.inference.numpy import kernels
  if not hasattr(os, "fork") or kernels.CORES < 2:
    pytest.skip("no fork, or one core: nothing is split")
  rng = np.random.default_rng(2)
  w = rng.standard_normal((64, 256), dtype=np.float32)
  x = rng.standard_normal((16, 64), dtype=np.float32)
  expected = kernels.matmul(x, w)  # the parent's workers are running now
  child = os.fork()
  if child == 0:  # the parent's workers do not exist here: without new ones this product would wait forever
    try:
      os._exit(0 if np.array_equal(kernels.matmul(x, w), expected) else 1)
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


async def test_batched_attention_matches_each_request_alone(engine):
  from tests.support.engines import check_batched_logits_match_alone
  await check_batched_logits_match_alone(engine)  # mixed lengths, chunked prompts, requests joining mid-flight

"""The numpy engine's parts, without the model: the KV pool's slots, the products shared among the cores (and their
worker threads), the attention jobs (decode runs, prompt chunks) shared among the cores, and RoPE's kernel."""
import gc
import os
import subprocess
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from exo.inference.numpy import attention, kernels, rotary
from exo.inference.numpy.cache import SLAB_SLOTS, KVCache, KVPool
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit


def test_cache_pool_slots_are_counted_and_reused():
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
  rng = np.random.default_rng(0)
  w = rng.standard_normal((96, 200), dtype=np.float32)  # 200 columns: uneven slices
  for rows in (1, kernels.PARALLEL_ROWS - 1, kernels.PARALLEL_ROWS, 40):
    x = rng.standard_normal((rows, 96), dtype=np.float32)
    np.testing.assert_allclose(kernels.matmul(x, w), x @ w, rtol=1e-6, atol=1e-5)
    bias = rng.standard_normal(200, dtype=np.float32)
    np.testing.assert_allclose(kernels.matmul(x, w, bias, then=np.tanh), np.tanh(x @ w + bias), rtol=1e-5, atol=1e-5)  # each slice's epilogue


def test_split_work_reports_a_workers_error_and_serves_concurrent_callers():
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
  code = ("import threading, numpy as np; from exo.inference.numpy import kernels, llama; n = threading.active_count(); "
          "kernels.matmul(np.ones((8, 8), np.float32), np.ones((8, 128), np.float32)); "
          "print(n, threading.active_count(), kernels.CORES)")
  output = subprocess.check_output([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, text=True)
  before, after, cores = map(int, output.split())
  assert before == 1 and after == cores, "one worker per extra core, started by the first product that needs them"


def test_attention_jobs_are_shared_evenly_and_runs_follow_consecutive_slots():
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


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("scale", [0.05, 3.0, -3.0])
def test_attention_equals_a_float64_softmax_whatever_the_scores(scale, sinks):
  """Attention takes exp(score) unshifted while that is exact and shifts by each row's max otherwise. Scores of
  +-190 (every key along the query's direction) overflow exp, or make every weight of a row underflow, unshifted:
  decode runs and prompt chunks (a long cached prefix, rows in several tiles, a causal part) still equal a float64
  softmax over each row's own positions. With sinks (gpt-oss), each head's sink logit, of the scores' size, joins
  every softmax's denominator."""
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
  sink_logits = (rng.standard_normal(n_kv * group) * 2 + 64 * scale).astype(np.float32) if sinks else None
  slab, first_slot = pool.where(caches[0].slot)
  attention.DecodeRun(slab, first_slot, 0, ends).attend(0, q, attn, n_kv, sinks=sink_logits)
  attention.PromptChunk(*pool.where(caches[1].slot), 3, start, n).attend(0, q, attn, n_kv, sinks=sink_logits)

  def expected(cache, row, seen):
    keys, values = cache.data[0, 0].astype(np.float64), cache.data[0, 1].astype(np.float64)
    out = []
    for head in range(n_kv * group):
      scores = keys[head // group, :seen] @ q[row, head]
      shift = scores.max() if sink_logits is None else max(scores.max(), sink_logits[head])
      weights = np.exp(scores - shift)
      total = weights.sum() + (0.0 if sink_logits is None else np.exp(sink_logits[head] - shift))
      out.append(weights @ values[head // group, :seen] / total)
    return np.concatenate(out)
  for row in range(rows):
    want = expected(caches[row], row, ends[row]) if row < 3 else expected(caches[1], row, start + row - 3 + 1)
    np.testing.assert_allclose(attn[row], want, rtol=0, atol=1e-4, err_msg=f"row {row}")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_decode_rows_attend_only_their_window_with_scores_soft_capped(dtype):
  """A sliding layer's decode row sees its last `window` positions; Gemma's soft cap bends every score. The compiled
  pass (a float32 cache) and numpy's (float16) both equal a float64 softmax over just those positions."""
  n_kv, group, hd, window, cap = 2, 2, 32, 40, 30.0
  rng = np.random.default_rng(3)
  pool = KVPool(n_layers=1, n_kv_heads=n_kv, head_dim=hd, positions=256, dtype=dtype)
  caches = [KVCache(pool) for _ in range(3)]
  for cache in caches:
    cache.data[0] = rng.standard_normal(cache.data[0].shape).astype(dtype)
  q = (4 * rng.standard_normal((3, n_kv * group, hd))).astype(np.float32)  # scores far past the cap
  ends = np.array([200, 30, 120])  # the second row sees fewer positions than the window
  attn = np.zeros((3, n_kv * group * hd), dtype=np.float32)
  slab, first_slot = pool.where(caches[0].slot)
  attention.DecodeRun(slab, first_slot, 0, ends).attend(0, q, attn, n_kv, window=window, softcap=cap)
  for row, (cache, end) in enumerate(zip(caches, ends)):
    keys, values = cache.data[0, 0].astype(np.float64), cache.data[0, 1].astype(np.float64)
    for head in range(n_kv * group):
      seen = slice(max(0, end - window), end)
      scores = cap * np.tanh(keys[head // group, seen] @ q[row, head] / cap)
      weights = np.exp(scores - scores.max())
      want = weights @ values[head // group, seen] / weights.sum()
      np.testing.assert_allclose(attn[row, head * hd:(head + 1) * hd], want, rtol=0, atol=1e-4, err_msg=f"row {row} head {head}")


async def test_a_forked_child_still_splits_its_products():
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

  def exited():
    pid, status = os.waitpid(child, os.WNOHANG)
    return pid and (status,)
  try:
    (status,) = await eventually(exited, 30, "the forked child's split product finished")
  except AssertionError:
    os.kill(child, 9)
    os.waitpid(child, 0)
    raise
  assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_rope_kernel_gives_numpys_bits_on_strided_heads(rows):
  """The compiled RoPE runs the same float32 operations in the same order as numpy's form, so a model's outputs do
  not move with it; heads are read from a slice of a product's output and written into a slice of the queries."""
  rng = np.random.default_rng(rows)
  projected = rng.standard_normal((rows, 15, 64), dtype=np.float32)
  heads = projected[:, 3:12]  # strided: every row skips the other heads
  angles = rng.uniform(-50, 50, (rows, 1, 32)).astype(np.float32)
  cos, sin = np.cos(angles), np.sin(angles)
  x1, x2 = heads[..., :32], heads[..., 32:]
  expected = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  scale = np.float32(0.125)
  queries = np.zeros((rows, 20, 64), dtype=np.float32)
  rotary.rope(heads, cos, sin, scale, out=queries[:, 2:11])
  assert np.array_equal(queries[:, 2:11], expected * scale)
  assert not queries[:, :2].any() and not queries[:, 11:].any()
  assert np.array_equal(rotary.rope(heads, cos, sin), expected)
  # shapes the kernel does not take (cos shared by every row) go through numpy's form, same result
  assert np.array_equal(rotary.rope(heads, cos[:1], sin[:1]), np.concatenate([x1 * cos[:1] - x2 * sin[:1], x2 * cos[:1] + x1 * sin[:1]], axis=-1))

"""The batching acceptance criterion on the real SmolLM2-135M: 32 requests with different prompt lengths, arriving at
random times, give greedy outputs identical to unbatched on one node, for every engine. (Over a real 2-process ring:
test_batching_ring.py.)"""
import asyncio
from typing import List, Tuple

import pytest

import exo.inference.mlx  # noqa: F401  (first: it binds OpenBLAS, which must precede mlx.core)
from exo.inference.sampling import SamplingParams
from exo.orchestration.batching.config import BatchingConfig
from tests.support import engines as common
from tests.support.models import random_arrivals, smollm2_shard
from tests.support.toy import make_node, settle

pytestmark = pytest.mark.model

BATCHING = BatchingConfig(batch_size=16, timeout_ms=5, prefill_chunk=32)


async def check_random_arrivals_match_unbatched(engine, jobs: List[Tuple[str, float]], max_tokens: int, timeout_s: float = 280):
  """The jobs through a node (a ring of one) with batching off, then on: the same greedy tokens, and batching really
  ran several requests per engine step. Returns the batched plugin's step stats."""
  from exo.orchestration.generation import generate
  params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

  async def run(config):
    node, plugin = make_node(engine, config)
    node.max_generate_tokens = max_tokens

    async def one(prompt, delay):
      await asyncio.sleep(delay)
      out = []
      async for tokens, _ in generate(node, smollm2_shard(), prompt, params, timeout=timeout_s):
        out += tokens
      return out
    outs = await asyncio.wait_for(asyncio.gather(*[one(p, d) for p, d in jobs]), timeout_s)
    await settle(node)
    return outs, plugin

  unbatched, _ = await run(None)
  batched, plugin = await run(BATCHING)
  mismatches = [(i, len(engine.tokenizer.encode(jobs[i][0])), u, b) for i, (u, b) in enumerate(zip(unbatched, batched)) if u != b]
  assert not mismatches, f"(request, prompt tokens, unbatched, batched): {mismatches}"
  assert all(len(o) == max_tokens for o in batched)
  assert len({tuple(o) for o in unbatched}) > len(jobs) // 2  # different answers, so a request given another's shows
  stats = plugin.step_stats()
  assert stats.mean > 2, stats  # requests really shared engine steps
  assert max(stats.sizes) <= BATCHING.batch_size, stats
  return stats


# --- one node, each engine ---

@pytest.fixture(scope="module")
def numpy_engine(downloader):
  from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
  return common.load_engine(NumpyDynamicShardInferenceEngine, downloader)


@pytest.fixture(scope="module")
def tinygrad_engine(downloader):
  pytest.importorskip("tinygrad")
  from exo.inference.tinygrad.engine import TinygradDynamicShardInferenceEngine
  return common.load_engine(TinygradDynamicShardInferenceEngine, downloader)


@pytest.fixture(scope="module")
def mlx_engine(downloader):
  pytest.importorskip("mlx.core")
  from exo.inference.mlx.engine import MLXDynamicShardInferenceEngine
  return common.load_engine(MLXDynamicShardInferenceEngine, downloader)


async def test_numpy_32_requests_at_random_times_match_unbatched(numpy_engine):
  await check_random_arrivals_match_unbatched(numpy_engine, random_arrivals(32, seed=7, word_counts=[2, 10, 40, 90]), max_tokens=5)


async def test_tinygrad_32_requests_at_random_times_match_unbatched(tinygrad_engine):
  # tinygrad on this CPU: ~130 ms a token, and each new mix of shapes in a step costs seconds of scheduling and jit
  # capture (a batched step here takes ~2.5 s). With the fixed 32-token prefill budget per step, the batched run's
  # length is about the prompts' total tokens / 32 steps, so its prompts are shorter than numpy's (1-24 words, not 2-90).
  await check_random_arrivals_match_unbatched(tinygrad_engine, random_arrivals(32, seed=11, word_counts=[1, 4, 10, 24]), max_tokens=3)


async def test_mlx_32_requests_at_random_times_match_unbatched(mlx_engine):
  await check_random_arrivals_match_unbatched(mlx_engine, random_arrivals(32, seed=13, word_counts=[2, 10, 40, 90]), max_tokens=5)

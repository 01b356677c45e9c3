"""The batching acceptance criterion on the real SmolLM2-135M: 32 requests with different prompt lengths, arriving at
random times, give greedy outputs identical to unbatched,
- on one node, for the tinygrad and MLX engines (the numpy engine's run is test_scheduler.py's
  test_smollm2_32_requests_at_random_times_match_unbatched; the check here is the same, shared by engine), and
- on a real 2-process ring (numpy) where BOTH nodes batch (test_batching_ring.py covers a mixed ring), against each
  prompt's answer alone on a ring of one."""
import asyncio
import random
import re
from typing import List, Sequence, Tuple

import pytest

import exo.inference.mlx  # noqa: F401  (first: it binds OpenBLAS, which must precede mlx.core)
from exo.inference.sampling import SamplingParams
from exo.orchestration.batching.config import BatchingConfig
from tests.support import engines as common
from tests.support.models import smollm2_shard
from tests.support.toy import make_node, settle

WORDS = "sun river stone apple cloud music garden ocean paper window silver forest".split()
BATCHING = BatchingConfig(batch_size=16, timeout_ms=5, prefill_chunk=32)


def random_arrivals(n: int, seed: int, word_counts: Sequence[int], max_delay_s: float = 1.0) -> List[Tuple[str, float]]:
  """n prompts of different lengths (a number of words from word_counts), each with its arrival delay."""
  rng = random.Random(seed)
  return [(f"Story {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.choice(word_counts))), rng.uniform(0, max_delay_s)) for i in range(n)]


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
def tinygrad_engine(downloader):
  pytest.importorskip("tinygrad")
  from exo.inference.tinygrad.engine import TinygradDynamicShardInferenceEngine
  return common.load_engine(TinygradDynamicShardInferenceEngine, downloader)


@pytest.fixture(scope="module")
def mlx_engine(downloader):
  pytest.importorskip("mlx.core")
  from exo.inference.mlx.engine import MLXDynamicShardInferenceEngine
  return common.load_engine(MLXDynamicShardInferenceEngine, downloader)


async def test_tinygrad_32_requests_at_random_times_match_unbatched(tinygrad_engine):
  # tinygrad on this CPU: ~130 ms a token, and each new mix of shapes in a step costs seconds of scheduling and jit
  # capture (a batched step here takes ~2.5 s). With the fixed 32-token prefill budget per step, the batched run's
  # length is about the prompts' total tokens / 32 steps, so its prompts are shorter than numpy's (1-24 words, not 2-90).
  await check_random_arrivals_match_unbatched(tinygrad_engine, random_arrivals(32, seed=11, word_counts=[1, 4, 10, 24]), max_tokens=3)


async def test_mlx_32_requests_at_random_times_match_unbatched(mlx_engine):
  await check_random_arrivals_match_unbatched(mlx_engine, random_arrivals(32, seed=13, word_counts=[2, 10, 40, 90]), max_tokens=5)


# --- a 2-process ring where both nodes batch ---

RING_MAX_TOKENS = 6
STOPPED_LINE = re.compile(r"^\[batching\] stopped; sampling: .*; engine steps: (\d+) batches, mean size ([\d.]+), sizes \{([^}]*)\}", re.M)


def engine_step_sizes(log: str) -> dict:
  """The histogram of engine step sizes a batching node prints when it stops (DEBUG=2)."""
  match = STOPPED_LINE.search(log)
  assert match, f"no '[batching] stopped' line:\n{log[-3000:]}"
  return {int(size): int(n) for size, n in (pair.split(":") for pair in match[3].split())}


async def test_ring_where_both_nodes_batch_32_requests_at_random_times_match_alone(tmp_path):
  """node-a and node-b both batch (EXO_BATCH_SIZE=8). References: each prompt asked alone while node-a is a ring of
  one. Then node-b joins and the same 32 prompts arrive at random times at both nodes' APIs, over the 2-node ring."""
  pytest.importorskip("exo.api", reason="the HTTP API (exo.api) is not installed")
  from tests.support.cluster import Cluster, chat

  def answer(reply: dict) -> tuple:
    return reply["choices"][0]["message"]["content"], reply["choices"][0]["finish_reason"], reply["usage"]["completion_tokens"]

  jobs = random_arrivals(32, seed=5, word_counts=[2, 10, 40, 90])
  env = {"DEBUG": "2", "EXO_BATCH_SIZE": "8", "EXO_BATCH_TIMEOUT_MS": "5"}
  cluster = Cluster(tmp_path, ["node-a", "node-b"], "numpy", env)
  try:
    cluster.nodes["node-a"].start()
    await cluster.wait_api("node-a")
    references = [answer(await chat(cluster.url("node-a"), "smollm2-135m", p, max_tokens=RING_MAX_TOKENS)) for p, _ in jobs]
    assert len(set(references)) > len(jobs) // 2  # different answers, so a request given another's shows
    await cluster.start(["node-b"])

    async def one(i, prompt, delay):
      await asyncio.sleep(delay)
      return answer(await chat(cluster.url("node-a" if i % 2 else "node-b"), "smollm2-135m", prompt, max_tokens=RING_MAX_TOKENS, timeout=120))
    answers = await asyncio.wait_for(asyncio.gather(*[one(i, p, d) for i, (p, d) in enumerate(jobs)]), 150)
    mismatches = [(i, jobs[i][0][:40], r, a) for i, (r, a) in enumerate(zip(references, answers)) if r != a]
    assert not mismatches, f"(request, prompt, alone, over the batching ring): {mismatches}"
    assert all(n == RING_MAX_TOKENS or reason == "stop" for _, reason, n in answers)
  finally:
    cluster.stop()  # SIGTERM: each node prints its batching stats as it stops
  logs = {node_id: node.log() for node_id, node in cluster.nodes.items()}
  for node_id, log in logs.items():
    assert "batching on: up to 8 requests per step" in log, node_id
    sizes = engine_step_sizes(log.rsplit("===== start", 1)[-1])
    assert max(sizes) > 1, f"{node_id} never ran two requests in one engine step: {sizes}"
    assert max(sizes) <= 8, f"{node_id}: {sizes}"
  # node-b (layers 0-14) ran only the concurrent phase (node-a's stats also count the one-at-a-time references)
  node_b_sizes = engine_step_sizes(logs["node-b"])
  assert sum(k * n for k, n in node_b_sizes.items()) / sum(node_b_sizes.values()) > 1.5, node_b_sizes
  sampled_together = [int(n) for log in logs.values() for n in re.findall(r"^\[batching\] sampled (\d+) request", log, re.M)]
  assert max(sampled_together) > 1, "no node ever sampled two requests together"

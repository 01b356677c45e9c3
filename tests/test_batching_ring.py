"""Batching across a real 2-process ring: node-a (layers 15-29, samples, serves HTTP) batches, node-b (layers 0-14)
does not. Requests still travel as their own SendTensor messages, so the mixed ring works, and concurrent greedy
answers equal the answers each prompt gets alone."""
import asyncio
import re

import pytest

pytest.importorskip("exo.api", reason="the HTTP API (exo.api) is not installed")

from tests.support.cluster import Cluster, chat  # noqa: E402

PROMPTS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in Spanish.",
           "Write one sentence about the sea and the wind over it at night.", "Who wrote Hamlet?"]
MAX_TOKENS = 10


def answer(reply: dict) -> str:
  return reply["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def mixed_pair(tmp_path_factory):
  """node-a batching on, node-b off. References: each prompt asked alone while node-a is a ring of one."""
  cluster = Cluster(tmp_path_factory.mktemp("batching_ring"), ["node-a", "node-b"], "numpy", {"DEBUG": "2"})
  node_a = cluster.nodes["node-a"]
  node_a.extra_env = {**node_a.extra_env, "EXO_BATCH_SIZE": "8", "EXO_BATCH_TIMEOUT_MS": "5"}  # its own copy: node-b stays off

  async def form():
    cluster.nodes["node-a"].start()
    await cluster.wait_api("node-a")
    cluster.references = [answer(await chat(cluster.url("node-a"), "smollm2-135m", p, max_tokens=MAX_TOKENS)) for p in PROMPTS]
    await cluster.start(["node-b"])
  try:
    asyncio.run(form())
    yield cluster
  finally:
    cluster.stop()


async def test_concurrent_requests_over_a_mixed_ring_match_alone(mixed_pair):
  replies = await asyncio.gather(*[chat(mixed_pair.url("node-a"), "smollm2-135m", p, max_tokens=MAX_TOKENS) for p in PROMPTS])
  assert [answer(r) for r in replies] == mixed_pair.references
  log_a, log_b = mixed_pair.nodes["node-a"].log(), mixed_pair.nodes["node-b"].log()
  assert "batching on: up to 8 requests per step" in log_a and "batching on" not in log_b
  sampled_together = [int(n) for n in re.findall(r"\[batching\] sampled (\d+) request", log_a)]
  assert max(sampled_together) > 1, "node-a never sampled two requests together"

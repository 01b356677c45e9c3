"""The batching acceptance criterion over a real 2-process ring (numpy) where BOTH nodes batch: 32 requests with
different prompt lengths, arriving at random times at both nodes' APIs, give each prompt's answer alone on a ring of
one. (A ring where only one node batches: test_mixed_ring.py.)"""
import asyncio
import re

import pytest

from tests.support.cluster import Cluster, chat
from tests.support.models import random_arrivals

pytestmark = pytest.mark.cluster

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

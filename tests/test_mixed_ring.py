"""A real 2-process ring: node-a (layers 15-29, samples, serves HTTP) batches, node-b (layers 0-14) does not.
Requests still travel as their own SendTensor messages, so the mixed ring works, and concurrent greedy answers equal
the answers each prompt gets alone. A request whose client leaves ends on both nodes within one prompt chunk, with
no KV memory left behind, whether it was streaming or not."""
import asyncio
import json
import re
import time
import urllib.request

import aiohttp

import pytest

pytest.importorskip("exo.api", reason="the HTTP API (exo.api) is not installed")

from tests.support.cluster import Cluster, chat  # noqa: E402
from tests.support.waiting import eventually  # noqa: E402

pytestmark = pytest.mark.cluster

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


# A 512-token prompt chunk of a ~2,500-token prompt takes 1-3 s here; a client that leaves frees both nodes by then.
END_BOUND_S = 8
LONG_PROMPT = "Summarise this text: " + "the quick brown fox jumps over the lazy dog while the cat sleeps " * 190


def state(cluster, node_id: str) -> dict:
  with urllib.request.urlopen(f"{cluster.url(node_id)}/v1/state", timeout=10) as response:
    return json.loads(response.read())


async def wait_for_state(cluster, condition, timeout: float, what: str) -> float:
  """Poll both nodes' /v1/state until `condition(state_a, state_b)`; returns when that was first seen."""
  seen = []

  async def holds():
    seen[:] = await asyncio.gather(*[asyncio.to_thread(state, cluster, n) for n in ("node-a", "node-b")])
    return condition(*seen) and time.monotonic()
  return await eventually(holds, timeout, lambda: f"{what}; last seen {seen}")


def idle(a: dict, b: dict) -> bool:
  return a["requests"] == [] == b["requests"] and a["kv_bytes"] == 0 == b["kv_bytes"]


async def post(cluster, body: dict, timeout: float):
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{cluster.url('node-a')}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
      return await response.read()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_leaves_mid_prefill_frees_both_nodes_within_a_chunk(mixed_pair, stream):
  body = {"model": "smollm2-135m", "stream": stream, "max_tokens": 16, "temperature": 0, "messages": [{"role": "user", "content": LONG_PROMPT}]}
  leaving = asyncio.ensure_future(post(mixed_pair, body, 300))
  await wait_for_state(mixed_pair, lambda a, b: any(r["kv_bytes"] > 0 for r in b["requests"]),
                       60, "node-b computing the prompt")
  leaving.cancel()  # the client goes away: its connection closes
  left = time.monotonic()
  freed = await wait_for_state(mixed_pair, idle, 60, "both nodes idle")
  assert freed - left < END_BOUND_S, freed - left
  reply = await chat(mixed_pair.url("node-a"), "smollm2-135m", "Say hi.", max_tokens=4, timeout=60)
  assert reply["usage"]["completion_tokens"] == 4


async def test_a_non_stream_request_whose_client_timed_out_stops_generating(mixed_pair):
  body = {"model": "smollm2-135m", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "messages": [{"role": "user", "content": "Tell a story."}]}
  with pytest.raises(asyncio.TimeoutError):
    await post(mixed_pair, body, 4)
  gave_up = time.monotonic()
  freed = await wait_for_state(mixed_pair, idle, 60, "both nodes idle")
  assert freed - gave_up < END_BOUND_S, freed - gave_up

"""Placement and routing across real `exo` processes (real gRPC over loopback, the real HTTP API, SmolLM2): a group
that loses its node ends exactly its own requests with an error naming the node while new requests avoid it; a node
that joins serves requests once its copy is loaded, without disturbing those in flight; and four processes that each
offer too little memory for a copy form two groups of two stages, both serving, answering as one node does."""
import asyncio
import json
import time
from typing import Dict, List, Optional

import aiohttp
import pytest

from tests.support.cluster import TOKEN_LINE, Cluster, chat
from tests.support.waiting import eventually

pytestmark = pytest.mark.cluster

MODEL = "smollm2-135m"
AUTO = {"EXO_PLACEMENT": "auto", "EXO_BATCH_SIZE": "8", "DEBUG": "2"}
PROMPTS = ["What is the capital of France?", "Name three colours.", "What is 2 + 2?", "Say hello in Spanish.",
           "Who wrote Hamlet?", "Write one sentence about the sea."]
DEAD_NODE_ERROR_BOUND_S = 12  # a killed node refuses the next health check (every 2 s), or a send fails at once


async def get(url: str, path: str) -> dict:
  async with aiohttp.ClientSession() as session:
    async with session.get(f"{url}{path}", timeout=aiohttp.ClientTimeout(total=10)) as response:
      return await response.json()


async def groups_ready(cluster: Cluster, node_id: str, count: int) -> Optional[List[dict]]:
  """The model's groups in `node_id`'s placement once there are `count` of them, every one loaded."""
  view = (await get(cluster.url(node_id), "/v1/topology"))["placement"]
  model = view.get("models", {}).get(MODEL)
  return model["groups"] if model and len(model["groups"]) == count and all(model["ready"]) else None


async def stream(url: str, content: str, max_tokens: int, record: dict) -> dict:
  """One streaming chat; `record` fills live with its chunks' count, its text and the error that ended it, if any."""
  body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": True, "max_tokens": max_tokens, "temperature": 0,
          "ignore_eos": True}
  record.update(chunks=0, text="", error=None)
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=300)) as response:
      assert response.status == 200, await response.text()
      async for line in response.content:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
          continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
          record["error"] = chunk["error"]["message"]
          record["ended"] = time.monotonic()
          continue
        record["chunks"] += 1
        record["text"] += (chunk["choices"][0].get("delta") or {}).get("content") or ""
  return record


def answer(reply: dict) -> str:
  return reply["choices"][0]["message"]["content"]


@pytest.fixture
def auto_cluster(tmp_path):
  clusters = []

  def make(ids, env=AUTO) -> Cluster:
    clusters.append(Cluster(tmp_path, ids, "numpy", dict(env)))
    return clusters[-1]
  yield make
  for cluster in clusters:
    cluster.stop()


async def test_a_group_that_loses_its_node_ends_exactly_its_requests_and_new_ones_avoid_it(auto_cluster):
  cluster = auto_cluster(["node-a", "node-b", "node-c"])
  await cluster.start()
  a = cluster.url("node-a")
  await chat(a, MODEL, "Hello.", max_tokens=2)  # the model in use: every node loads its copy
  await eventually(lambda: groups_ready(cluster, "node-a", 3), 120, "three groups loaded")
  records = [{} for _ in range(3)]
  streams = [asyncio.ensure_future(stream(a, p, 80, r)) for p, r in zip(PROMPTS, records)]
  groups_of: Dict[str, str] = {}

  async def on_c():  # /v1/state says which group each request is on
    for request in (await get(a, "/v1/state"))["requests"]:
      groups_of[request["id"]] = request["group"]
    return "node-c" in groups_of.values() and all(r.get("chunks", 0) >= 4 for r in records)
  await eventually(on_c, 120, "a request streaming on node-c's group")
  assert sorted(groups_of.values()) == ["node-a", "node-b", "node-c"]  # a burst spreads at once
  cluster.nodes["node-c"].kill()
  killed = time.monotonic()
  done = await asyncio.gather(*streams)
  failed = [r for r in done if r["error"]]
  assert len(failed) == 1 and "node-c" in failed[0]["error"], done
  assert failed[0]["ended"] - killed < DEAD_NODE_ERROR_BOUND_S
  assert all(r["chunks"] == 80 for r in done if not r["error"])  # the other groups' requests went on to the end
  await eventually(lambda: groups_ready(cluster, "node-a", 2), DEAD_NODE_ERROR_BOUND_S, "node-c's group gone from the placement")
  seen = set()

  async def watch():
    while True:
      seen.update(r["group"] for r in (await get(a, "/v1/state"))["requests"])
      await asyncio.sleep(0.05)
  watcher = asyncio.ensure_future(watch())
  try:
    replies = await asyncio.gather(*[chat(a, MODEL, p, max_tokens=8) for p in PROMPTS[3:]])
  finally:
    watcher.cancel()
  assert all(r["usage"]["completion_tokens"] == 8 for r in replies) and seen <= {"node-a", "node-b"} and seen


async def test_a_node_that_joins_takes_requests_once_its_copy_is_loaded_and_disturbs_none(auto_cluster):
  cluster = auto_cluster(["node-a", "node-b", "node-c"])
  await cluster.start(["node-a", "node-b"])
  a, b = cluster.url("node-a"), cluster.url("node-b")
  # The answers each prompt gets alone (asked one at a time at node-b, whose router keeps them on its own copy).
  references = [answer(await chat(b, MODEL, p, max_tokens=8)) for p in PROMPTS]
  await eventually(lambda: groups_ready(cluster, "node-a", 2), 120, "two groups loaded")
  records = [{} for _ in range(2)]
  running = [asyncio.ensure_future(stream(a, p, 60, r)) for p, r in zip(PROMPTS, records)]
  async def streaming():
    return all(r.get("chunks", 0) >= 2 for r in records)
  await eventually(streaming, 60, "two requests streaming")
  cluster.nodes["node-c"].start()
  await eventually(lambda: groups_ready(cluster, "node-a", 3), 120, "node-c's copy loaded and in node-a's placement")
  done = await asyncio.gather(*running)
  assert [(r["error"], r["chunks"]) for r in done] == [(None, 60), (None, 60)]  # nothing in flight was disturbed
  served_before = len(TOKEN_LINE.findall(cluster.nodes["node-c"].log()))
  replies = await asyncio.gather(*[chat(a, MODEL, p, max_tokens=8) for p in PROMPTS])  # node-a's router has not seen them
  assert [answer(r) for r in replies] == references
  assert len(TOKEN_LINE.findall(cluster.nodes["node-c"].log())) - served_before >= 8  # node-c served at least one of them


async def test_four_nodes_too_small_for_a_copy_form_two_pipelines_of_two_and_both_serve(auto_cluster):
  ids = ["quad-1", "quad-2", "quad-3", "quad-4"]
  # a copy needs about 814 MiB (the GGUF kept quantized, 0.73 bytes a weight, and 755 MiB of KV reserve): two hold one
  cluster = auto_cluster(ids, {**AUTO, "EXO_MEMORY_MB": "600"})
  await cluster.start()
  first, second = cluster.url("quad-1"), cluster.url("quad-2")
  await chat(first, MODEL, "Hello.", max_tokens=2)  # every node loads its stage of the model in use
  groups = await eventually(lambda: groups_ready(cluster, "quad-1", 2), 180, "two groups of two loaded")
  assert [len(g["stages"]) for g in groups] == [2, 2] and sorted(s["node_id"] for g in groups for s in g["stages"]) == ids
  assert all(g["stages"][0]["start_layer"] == 0 and g["stages"][1]["end_layer"] == 29 for g in groups)
  # Alone, one at a time, at a node whose router keeps them on its own group: the references.
  references = [answer(await chat(second, MODEL, p, max_tokens=8)) for p in PROMPTS[:4]]
  last_stages = [g["stages"][-1]["node_id"] for g in groups]
  before = {n: len(TOKEN_LINE.findall(cluster.nodes[n].log())) for n in last_stages}
  replies = await asyncio.gather(*[chat(first, MODEL, p, max_tokens=8) for p in PROMPTS[:4]])
  assert [answer(r) for r in replies] == references
  assert all(len(TOKEN_LINE.findall(cluster.nodes[n].log())) > before[n] for n in last_stages)  # both groups sampled answers

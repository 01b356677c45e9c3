"""Limits on the real SmolLM2 (numpy engine): prompts checked against the model's context before anything is
allocated, bodies against the size limit, the node's event loop free while a huge prompt is read and rejected, the
KV budget holding a request back until another ends, and the KV memory a running request holds, as /metrics shows it."""
import asyncio
import json
import re
import time

import aiohttp
import pytest

from exo.api.settings import ApiSettings
from tests.support.api_server import ApiServer, scrape, shared_server
from tests.support.waiting import eventually

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
STORY = [{"role": "user", "content": "Tell me a short story about a dragon."}]
CONTEXT = 8192  # the GGUF's llama.context_length


@pytest.fixture(scope="module")
def server():
  return shared_server("numpy")


async def post(session, url, body):
  async with session.post(url, json=body) as r:
    return r.status, await r.json()


async def stream_text(session, url, body) -> str:
  async with session.post(url, json={**body, "stream": True}) as r:
    assert r.status == 200, await r.text()
    text = []
    async for line in r.content:
      if line.startswith(b"data: "):
        event = json.loads(line[6:])
        assert "error" not in event, event
        text.append(event["choices"][0]["delta"]["content"])
  return "".join(text)


@pytest.mark.asyncio
async def test_prompt_beyond_the_context_is_400_with_both_numbers(server):
  async with aiohttp.ClientSession() as session:
    status, body = await post(session, f"{server.url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hello " * 9000}]})
  assert status == 400 and body["error"]["code"] == "context_length_exceeded" and body["error"]["param"] == "messages"
  match = re.fullmatch(r"the prompt is ([\d,]+) tokens; this model's context is 8,192 \(shorten the messages\)", body["error"]["message"])
  assert match and int(match[1].replace(",", "")) > CONTEXT, body


@pytest.mark.asyncio
async def test_max_tokens_beyond_what_the_context_leaves_is_400(server):
  async with aiohttp.ClientSession() as session:
    status, body = await post(session, f"{server.url}/v1/chat/completions", {"model": MODEL, "messages": STORY, "max_tokens": CONTEXT})
  assert status == 400 and body["error"]["param"] == "max_tokens" and body["error"]["code"] == "context_length_exceeded"
  match = re.fullmatch(r"the prompt is (\d+) tokens and max_tokens asks for 8,192 more; this model's context is 8,192 \(ask for at most ([\d,]+)\)",
                       body["error"]["message"])
  assert match and int(match[1]) + int(match[2].replace(",", "")) == CONTEXT, body


@pytest.mark.asyncio
async def test_without_max_tokens_the_reply_may_take_what_the_context_leaves(server):
  seen = []
  server.api.on_chat_completion_request = lambda request_id, chat, prompt: seen.append(chat.params.max_tokens)
  try:
    async with aiohttp.ClientSession() as session:
      status, body = await post(session, f"{server.url}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}]})
  finally:
    server.api.on_chat_completion_request = None
  assert status == 200 and seen == [CONTEXT - body["usage"]["prompt_tokens"]]


@pytest.mark.asyncio
async def test_a_huge_prompt_is_rejected_while_the_node_keeps_serving(server):
  """A 2.2 MB prompt (under the 8 MiB body limit, 420,000 tokens) is tokenised off the event loop: /healthcheck answers within a
  second throughout, bad requests get their 400s, and a stream running meanwhile gives exactly its solo output."""
  url = f"{server.url}/v1/chat/completions"
  story = {"model": MODEL, "messages": STORY, "max_tokens": 60}
  huge = {"model": MODEL, "messages": [{"role": "user", "content": "the quick brown fox jumps over the lazy dog " * 50_000}]}
  async with aiohttp.ClientSession() as session:
    solo = await stream_text(session, url, story)
    rejected = asyncio.create_task(post(session, url, huge))
    streamed = asyncio.create_task(stream_text(session, url, story))
    bad = asyncio.gather(*[post(session, url, {"model": MODEL, "messages": STORY, **change})
                           for change in ({"top_k": 10**29}, {"top_logprobs": 21, "logprobs": True}, {"n": 1.0}, {"max_tokens": 10**6})])
    health_times = []
    while not rejected.done():
      started = time.monotonic()
      async with session.get(f"{server.url}/healthcheck") as r:
        assert r.status == 200
      health_times.append(time.monotonic() - started)
      await asyncio.sleep(0.1)
    status, body = await rejected
    assert status == 400 and body["error"]["code"] == "context_length_exceeded" and "this model's context is 8,192" in body["error"]["message"]
    assert all(status == 400 and "error" in body for status, body in await bad)
    assert await streamed == solo
  assert len(health_times) >= 5 and max(health_times) < 1.0, health_times


@pytest.mark.asyncio
async def test_a_body_over_the_limit_is_413_and_the_node_goes_on():
  s = ApiServer("dummy", settings=ApiSettings(max_body_bytes=2**20)).start()
  try:
    async with aiohttp.ClientSession() as session:
      status, body = await post(session, f"{s.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 2**21}]})
      assert status == 413 and body["error"]["code"] == "request_too_large" and "limit of 1,048,576 bytes" in body["error"]["message"]
      status, body = await post(session, f"{s.url}/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 1000}]})
      assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
  finally:
    s.stop()


async def test_the_kv_budget_holds_a_request_back_until_the_running_one_ends(server):
  """SmolLM2 keeps 46,080 bytes of KV per position in the numpy engine (30 layers x K and V x 3 heads x 64 x float32):
  admission counts at the engine's width (tests/test_kv_width.py for float16). With a budget
  that fits one request's prompt and max_tokens but not two, the second waits, then runs; one that cannot fit even
  alone is refused."""
  admission = server.api.admission
  budget = admission.kv_budget
  admission.kv_budget = 46_080 * 120  # one request: about 40 prompt tokens + 60 generated
  url, body = f"{server.url}/v1/chat/completions", {"model": MODEL, "messages": STORY, "max_tokens": 60, "ignore_eos": True}
  try:
    async with aiohttp.ClientSession() as session:
      async def one_running_one_waiting() -> bool:
        async with session.get(f"{server.url}/health") as r:
          health = await r.json()
        return (health["requests_running"], health["requests_waiting"]) == (1, 1)
      both = asyncio.gather(post(session, url, body), post(session, url, body))
      await eventually(one_running_one_waiting)
      assert [reply["usage"]["completion_tokens"] for _, reply in await both] == [60, 60]
      status, reply = await post(session, url, {**body, "max_tokens": 200})
      assert status == 400 and reply["error"]["code"] == "kv_budget_exceeded" and reply["error"]["param"] == "max_tokens", reply
  finally:
    admission.kv_budget = budget


async def test_kv_cache_bytes_while_a_request_runs_and_after(server):
  body = {"model": MODEL, "messages": STORY, "max_tokens": 30, "ignore_eos": True, "stream": True}
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{server.url}/v1/chat/completions", json=body) as r:
      await r.content.readuntil(b"\n\n")  # generating: its KV cache is held
      during = await scrape(server.url)
      async for _ in r.content:
        pass
  assert during[("exo_kv_cache_bytes", ())] > 0 and during[("exo_requests_running", ())] == 1
  async def freed():  # once the request ends
    return (await scrape(server.url))[("exo_kv_cache_bytes", ())] == 0
  await eventually(freed, 20)

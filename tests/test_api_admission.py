"""Admission control over real HTTP: caps on running and waiting requests (429 with Retry-After beyond them), waiting
requests that leave the queue with their clients, and /health (the KV budget on the real SmolLM2: test_api_limits.py)."""
import asyncio
import json

import aiohttp
import pytest

from exo.api.admission import Admission
from exo.api.errors import ApiError, BadRequest
from exo.api.settings import ApiSettings
from tests.support.api_server import SlowEngine
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hello"}]


async def health(session, url) -> dict:
  async with session.get(f"{url}/health") as r:
    body = await r.json()
    return {"http": r.status, **body}


def content_of(text: str) -> str:
  """The answer's text, from a non-stream reply or an SSE stream."""
  if text.startswith("data: "):
    return "".join(json.loads(e[6:])["choices"][0]["delta"]["content"] for e in text.strip().split("\n\n"))
  return json.loads(text)["choices"][0]["message"]["content"]


async def chat(session, url, body):
  async with session.post(f"{url}/v1/chat/completions", json=body) as r:
    return r.status, r.headers, await r.text()


@pytest.mark.asyncio
async def test_caps_of_two_and_two_give_four_answers_and_four_429s(make_server):
  s = make_server(SlowEngine(delay=0.05), settings=ApiSettings(max_running=2, max_queued=2))
  async with aiohttp.ClientSession() as session:
    results = await asyncio.gather(*[chat(session, s.url, {"messages": USER, "stream": i % 2 == 0}) for i in range(8)])
    assert sorted(status for status, _, _ in results) == [200] * 4 + [429] * 4
    for status, headers, text in results:
      if status == 200:
        assert content_of(text) == "dummy" * 10
      else:
        assert int(headers["Retry-After"]) >= 1
        error = json.loads(text)["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
        assert "EXO_MAX_CONCURRENT_REQUESTS=2" in error["message"] and "EXO_MAX_QUEUED_REQUESTS=2" in error["message"]
    assert await health(session, s.url) == {"http": 200, "status": "ok", "requests_running": 0, "requests_waiting": 0, "peers": 0}
    status, _, text = await chat(session, s.url, {"messages": USER})  # places free again once the answers are done
    assert status == 200


@pytest.mark.asyncio
async def test_a_waiting_request_whose_client_leaves_gives_up_its_place(make_server):
  s = make_server(SlowEngine(delay=0.1), settings=ApiSettings(max_running=1, max_queued=1))
  long = {"messages": USER, "max_tokens": 200, "ignore_eos": True}  # ~20 s unless cancelled
  async with aiohttp.ClientSession() as session:
    running = asyncio.create_task(chat(session, s.url, long))
    await eventually(lambda: _is(session, s.url, running=1, waiting=0))
    waiting = asyncio.create_task(chat(session, s.url, long))
    await eventually(lambda: _is(session, s.url, running=1, waiting=1))
    assert (await health(session, s.url))["http"] == 503  # every place taken: not ready for more
    assert (await chat(session, s.url, {"messages": USER}))[0] == 429
    waiting.cancel()  # its client hangs up
    await eventually(lambda: _is(session, s.url, running=1, waiting=0))
    third = asyncio.create_task(chat(session, s.url, {"messages": USER}))  # takes the freed place in the queue
    await eventually(lambda: _is(session, s.url, running=1, waiting=1))
    running.cancel()
    status, _, text = await third
    assert status == 200 and content_of(text) == "dummy" * 10


async def _is(session, url, running, waiting) -> bool:
  h = await health(session, url)
  return (h["requests_running"], h["requests_waiting"]) == (running, waiting)


@pytest.mark.asyncio
async def test_admission_is_first_come_first_served():
  admission = Admission(max_running=1, max_queued=3, kv_budget=100)
  order = []

  release = asyncio.Event()

  async def request(name, kv):
    async with admission.place() as ticket:
      await ticket.admit(kv)
      order.append(name)
      await release.wait()  # running until the test lets them all go

  first = asyncio.create_task(request("a", 90))
  await eventually(lambda: order == ["a"], 5)
  others = [asyncio.create_task(request("b", 60)), asyncio.create_task(request("c", 10))]
  await eventually(lambda: admission.waiting == 2, 5)  # both wait for a
  release.set()
  await asyncio.gather(first, *others)
  assert order == ["a", "b", "c"]  # c fits beside a's KV but never overtakes b
  with pytest.raises(BadRequest, match="more than this node's whole budget"):
    async with admission.place() as ticket:
      await ticket.admit(101)
  assert (admission.held, admission.running, admission.kv_in_use, len(admission.queue)) == (0, 0, 0, 0)
  full = Admission(max_running=1, max_queued=0, kv_budget=100)
  async with full.place() as ticket:
    await ticket.admit(1)
    with pytest.raises(ApiError) as e:
      async with full.place():
        pass
    assert e.value.status == 429 and e.value.headers["Retry-After"].isdigit()

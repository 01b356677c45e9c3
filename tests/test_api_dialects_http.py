"""Anthropic Messages, OpenAI Responses and Ollama over raw HTTP with the dummy engine: each dialect gets the same
limits, admission, access checks, timeouts, cancellation on disconnect and metrics as chat completions, every error
in its own shape; its streams are framed as its clients read them (named SSE events, NDJSON by default); and
Ollama's model routes answer."""
import asyncio
import json
from dataclasses import dataclass
from typing import Callable

import aiohttp
import anthropic
import pytest
from prometheus_client.parser import text_string_to_metric_families

from exo.api.settings import ApiSettings
from exo.orchestration.requests import Status
from tests.support.api_server import SlowEngine, shared_server

from tests.support.waiting import eventually

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hello"}]
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                   415: "invalid_request_error", 429: "rate_limit_error", 504: "timeout_error"}


def anthropic_error(status: int, body: dict) -> str:
  assert list(body) == ["type", "error"] and body["type"] == "error" and list(body["error"]) == ["type", "message"], body
  assert body["error"]["type"] == ANTHROPIC_TYPES[status], body
  return body["error"]["message"]


def openai_error(status: int, body: dict) -> str:
  assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"], body
  return body["error"]["message"]


def ollama_error(status: int, body: dict) -> str:
  assert list(body) == ["error"] and isinstance(body["error"], str), body
  return body["error"]


@dataclass
class Dialect:
  path: str
  body: Callable[[bool], dict]  # a request for the dummy model, streamed or not
  error_of: Callable[[int, dict], str]  # checks an error body's shape, gives its message
  first_token: bytes  # what the stream's line with the first token's text holds
  ndjson: bool = False  # else named SSE

  def events(self, text: str) -> list:
    """A stream's bodies, each checked for its framing."""
    if self.ndjson:
      assert text.endswith("\n")
      return [json.loads(line) for line in text.splitlines()]
    bodies = []
    for event in text.rstrip("\n").split("\n\n"):
      name, data = event.split("\n")
      body = json.loads(data.removeprefix("data: "))
      assert name == f"event: {body['type']}", event
      bodies.append(body)
    return bodies


DIALECTS = {
  "anthropic": Dialect("/v1/messages", lambda stream: {"model": "dummy", "max_tokens": 50, "messages": USER, "stream": stream}, anthropic_error,
                       b'"text": "dummy"'),
  "responses": Dialect("/v1/responses", lambda stream: {"model": "dummy", "input": "hello", "stream": stream}, openai_error, b'"delta": "dummy"'),
  "ollama chat": Dialect("/api/chat", lambda stream: {"model": "dummy", "messages": USER, "stream": stream}, ollama_error, b'"content": "dummy"',
                         ndjson=True),
  "ollama generate": Dialect("/api/generate", lambda stream: {"model": "dummy", "prompt": "hello", "stream": stream}, ollama_error, b'"response": "dummy"',
                             ndjson=True),
}
each_dialect = pytest.mark.parametrize("dialect", list(DIALECTS.values()), ids=list(DIALECTS))


async def post(url, body, headers=None, raw=False):
  async with aiohttp.ClientSession() as session:
    data = body if raw else json.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})}) as r:
      return r.status, r.headers, await r.text()


async def get(url):
  async with aiohttp.ClientSession() as session:
    async with session.get(url) as r:
      return r.status, await r.json()


def error_of(dialect: Dialect, status: int, text: str, expected: int) -> str:
  assert status == expected, text
  return dialect.error_of(status, json.loads(text))


@pytest.fixture(scope="module")
def server():
  return shared_server("dummy")


# --- errors in each dialect's shape ---

@each_dialect
async def test_bad_bodies_methods_and_pages_are_refused_in_the_dialects_shape(server, dialect):
  url = server.url + dialect.path
  assert "Invalid JSON body" in error_of(dialect, *(await post(url, "{", raw=True))[::2], 400)
  assert "Content-Type" in error_of(dialect, *(await post(url, dialect.body(False), {"Content-Type": "text/plain"}))[::2], 415)
  assert "EXO_ALLOWED_ORIGINS" in error_of(dialect, *(await post(url, dialect.body(False), {"Origin": "http://evil.example"}))[::2], 403)
  async with aiohttp.ClientSession() as session:
    async with session.get(url) as r:
      assert "nothing here: GET" in error_of(dialect, r.status, await r.text(), 404)  # (every other GET path is tinychat's)
  status, _, text = await post(url, dialect.body(False))
  assert status == 200 and "dummy" * 10 in text


@each_dialect
async def test_the_api_key_is_needed_and_x_api_key_carries_it(make_server, dialect):
  s = make_server("dummy", settings=ApiSettings(api_key="sekrit"))
  url = s.url + dialect.path
  for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
    assert "API key" in error_of(dialect, *(await post(url, dialect.body(False), headers))[::2], 401)
  for headers in ({"x-api-key": "sekrit"}, {"Authorization": "Bearer sekrit"}):
    assert (await post(url, dialect.body(False), headers))[0] == 200


async def test_the_anthropic_client_sends_its_key_as_x_api_key(make_server):
  s = make_server("dummy", settings=ApiSettings(api_key="sekrit"))
  client = anthropic.AsyncAnthropic(base_url=s.url, api_key="sekrit", max_retries=0)
  assert (await client.messages.count_tokens(model="dummy", messages=USER)).input_tokens == 1
  with pytest.raises(anthropic.AuthenticationError) as error:
    await anthropic.AsyncAnthropic(base_url=s.url, api_key="nope", max_retries=0).messages.create(model="dummy", max_tokens=5, messages=USER)
  assert error.value.body["error"]["type"] == "authentication_error"
  await client.close()


@each_dialect
async def test_every_place_taken_is_a_429_in_the_dialects_shape(make_server, dialect):
  s = make_server(SlowEngine(delay=0.3), settings=ApiSettings(max_running=1, max_queued=0))
  async with aiohttp.ClientSession() as session:
    holder = asyncio.create_task(session.post(f"{s.url}/v1/chat/completions", json={"messages": USER}))
    await eventually(lambda: s.api.admission.running == 1)
    status, headers, text = await post(s.url + dialect.path, dialect.body(dialect.ndjson))
    assert "EXO_MAX_CONCURRENT_REQUESTS=1" in error_of(dialect, status, text, 429) and int(headers["Retry-After"]) >= 1
    assert s.api.admission.running == 1  # the holder still held its place: the 429 was for want of one
    holder.cancel()  # its client leaves; nothing more to wait for


@each_dialect
async def test_a_timeout_is_a_504_or_ends_the_stream_in_the_dialects_shape(make_server, dialect):
  s = make_server(SlowEngine(delay=5), response_timeout=0.75)
  assert "response timeout of 0.75 s" in error_of(dialect, *(await post(s.url + dialect.path, dialect.body(False)))[::2], 504)
  s = make_server(SlowEngine(delay=5, fast=3), response_timeout=0.75)
  status, _, text = await post(s.url + dialect.path, dialect.body(True))
  assert status == 200  # tokens had gone out: the stream ends with the error
  events = dialect.events(text)
  if dialect.error_of is anthropic_error:
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "error" and events[-1]["error"]["type"] == "timeout_error"
  elif dialect.error_of is openai_error:
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"] and events[-2]["code"] == "response_timeout"
    assert events[-1]["response"]["status"] == "failed"
  else:
    assert "response timeout" in events[-1]["error"] and all(not e["done"] for e in events[:-1])


@each_dialect
async def test_a_client_leaving_a_stream_cancels_its_generation(make_server, dialect):
  s = make_server(SlowEngine(delay=0.3))
  tokens = {}
  s.node.on_token.register("test-counter").on_next(lambda request_id, new, finished: tokens.__setitem__(request_id, tokens.get(request_id, 0) + len(new)))
  async with aiohttp.ClientSession() as session:
    async with session.post(s.url + dialect.path, json=dialect.body(True)) as r:
      async for line in r.content:
        if dialect.first_token in line:
          break  # leave once the first token has come
  request_id = next(iter(tokens))
  await eventually(lambda: s.node.requests.ended(request_id) is Status.CANCELLED and s.api.admission.held == 0)
  assert tokens[request_id] < 10


# --- streams as each client reads them ---

async def test_anthropic_stream_events_in_order(server):
  status, headers, text = await post(server.url + "/v1/messages", DIALECTS["anthropic"].body(True))
  assert status == 200 and headers["Content-Type"] == "text/event-stream"
  events = DIALECTS["anthropic"].events(text)
  kinds = [e["type"] for e in events]
  assert kinds == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * 10 + ["content_block_stop", "message_delta", "message_stop"]
  assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "dummy" * 10
  assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None} and events[-2]["usage"] == {"output_tokens": 10}


async def test_responses_are_never_stored(server):
  async with aiohttp.ClientSession() as session:
    async with session.get(f"{server.url}/v1/responses/resp_123") as r:
      assert "stores no responses" in error_of(DIALECTS["responses"], r.status, await r.text(), 404)


async def test_responses_stream_events_are_numbered_and_end_completed(server):
  status, _, text = await post(server.url + "/v1/responses", DIALECTS["responses"].body(True))
  events = DIALECTS["responses"].events(text)
  assert status == 200 and [e["sequence_number"] for e in events] == list(range(len(events)))
  assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"][0]["content"][0]["text"] == "dummy" * 10


async def test_ollama_streams_ndjson_unless_told_not_to(server):
  body = {"model": "dummy:latest", "messages": USER}  # no "stream": Ollama's default is to stream
  status, headers, text = await post(server.url + "/api/chat", body)
  lines = DIALECTS["ollama chat"].events(text)
  assert status == 200 and headers["Content-Type"] == "application/x-ndjson"
  assert "".join(line["message"]["content"] for line in lines) == "dummy" * 10 and [line["done"] for line in lines] == [False] * 10 + [True]
  assert lines[-1]["done_reason"] == "stop" and lines[-1]["eval_count"] == 10 and lines[-1]["model"] == "dummy:latest"
  status, headers, text = await post(server.url + "/api/chat", {**body, "stream": False})
  assert headers["Content-Type"].startswith("application/json") and json.loads(text)["message"]["content"] == "dummy" * 10


# --- Ollama's model routes ---

async def test_ollama_model_routes(server):
  assert await get(f"{server.url}/api/version") == (200, {"version": "0.12.0"})
  status, tags = await get(f"{server.url}/api/tags")
  # the chat model, and the embedding model from its wheel (installed as the README's test command does)
  assert status == 200 and [m["name"] for m in tags["models"]] == ["dummy:latest", "all-minilm-l6-v2:latest"]
  assert all(len(m["digest"]) == 64 for m in tags["models"]) and tags["models"][1]["details"]["family"] == "bert"
  status, _, text = await post(f"{server.url}/api/generate", {"model": "dummy"})  # an empty prompt: Ollama's "load the model"
  assert status == 200 and json.loads(text)["done_reason"] == "load"
  await post(f"{server.url}/api/generate", {"model": "dummy", "prompt": "hi", "stream": False})
  status, ps = await get(f"{server.url}/api/ps")
  # the chat model; the embedding model too where a test of this server used it (tests/test_embeddings_keep_alive.py checks it)
  assert status == 200 and [m["model"] for m in ps["models"]][:1] == ["dummy:latest"] and len(ps["models"]) <= 2
  status, _, text = await post(f"{server.url}/api/show", {"model": "dummy"})
  assert status == 200 and set(json.loads(text)) >= {"template", "details", "model_info", "capabilities"}
  status, _, text = await post(f"{server.url}/api/show", {"model": "llama3"})
  assert status == 404 and json.loads(text) == {"error": "model 'llama3' not found"}
  status, _, text = await post(f"{server.url}/api/nothing", {})
  assert status == 405 and list(json.loads(text)) == ["error"]


# --- metrics ---

async def test_every_dialect_is_counted_in_the_metrics(make_server):
  s = make_server("dummy")
  for dialect in DIALECTS.values():
    assert (await post(s.url + dialect.path, dialect.body(False)))[0] == 200
    assert (await post(s.url + dialect.path, "{", raw=True))[0] == 400
  async with aiohttp.ClientSession() as session:
    async with session.get(f"{s.url}/metrics") as r:
      samples = {(m.name, tuple(sorted(m.labels.items()))): m.value for f in text_string_to_metric_families(await r.text()) for m in f.samples}
  assert samples[("exo_prompt_tokens_total", ())] == 4 and samples[("exo_generation_tokens_total", ())] == 40
  assert samples[("exo_time_to_first_token_seconds_count", ())] == 4
  assert samples[("exo_errors_total", (("kind", "invalid_json"),))] == 4

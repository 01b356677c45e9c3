"""The HTTP API over raw HTTP with the dummy engine: upstream's exact shapes and SSE quirks, every error path in
OpenAI's error shape, timeouts, and that bad or failing requests never disturb the others."""
import asyncio
import json
import re

import aiohttp
import openai
import pytest

from exo.api.reply_text import ReplyText
from exo.download.download_progress import RepoProgressEvent
from exo.embeddings.registry import embedding_cards
from exo.inference.shard import Shard
from exo.models import model_cards
from exo.orchestration.requests import Status
from tests.support.api_server import FailingEngine, SlowEngine, shared_server
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hello"}]
ID = r"chatcmpl-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


@pytest.fixture(scope="module")
def server():
  return shared_server("dummy")


async def post(url, body, raw=False, headers=None):
  async with aiohttp.ClientSession() as session:
    data = body if raw else json.dumps(body)
    async with session.post(url, data=data, headers=headers or {"Content-Type": "application/json"}) as r:
      return r.status, r.headers, await r.text()


async def get(url, headers=None):
  async with aiohttp.ClientSession() as session:
    async with session.get(url, headers=headers) as r:
      return r.status, r.headers, await r.text()


def error_of(status, headers, text, expected_status=400):
  """The error object of an OpenAI-shaped error reply."""
  assert status == expected_status, text
  assert headers["Content-Type"] == "application/json; charset=utf-8"
  body = json.loads(text)
  assert list(body) == ["error"] and list(body["error"]) == ["message", "type", "param", "code"], body
  return body["error"]


def events_of(text):
  assert text.endswith("\n\n")
  return text[:-2].split("\n\n")


# --- upstream parity (dummy engine) ---

@pytest.mark.asyncio
async def test_non_stream_matches_upstream_byte_for_byte(server):
  status, headers, text = await post(f"{server.url}/v1/chat/completions", {"model": "dummy", "messages": USER})
  assert status == 200 and headers["Content-Type"] == "application/json; charset=utf-8"
  expected = ('{"id": "ID", "object": "chat.completion", "created": T, "model": "dummy", "system_fingerprint": "exo_0.0.1", '
              '"choices": [{"index": 0, "message": {"role": "assistant", "content": "' + "dummy" * 10 + '"}, "logprobs": null, '
              '"finish_reason": "stop"}], "usage": {"prompt_tokens": 1, "completion_tokens": 10, "total_tokens": 11}}')
  assert re.sub(r'"created": \d+', '"created": T', re.sub(ID, "ID", text)) == expected


@pytest.mark.asyncio
async def test_stream_matches_upstream_sse_format(server):
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{server.url}/v1/chat/completions", json={"model": "dummy", "messages": USER, "stream": True}) as r:
      assert r.status == 200
      assert r.headers["Content-Type"] == "text/event-stream" and r.headers["Cache-Control"] == "no-cache"
      assert r.headers["Transfer-Encoding"] == "chunked"
      text = await r.text()
  events = events_of(text)
  assert len(events) == 10 and "[DONE]" not in text
  ids = set()
  for i, event in enumerate(events):
    assert event.startswith("data: {") and "\n" not in event
    body = json.loads(event[len("data: "):])
    ids.add(body["id"])
    finish = "stop" if i == 9 else None
    expected = ('{"id": "ID", "object": "chat.completion", "created": T, "model": "dummy", "system_fingerprint": "exo_0.0.1", '
                '"choices": [{"index": 0, "message": {"role": "assistant", "content": "dummy"}, "logprobs": null, '
                f'"finish_reason": {json.dumps(finish)}, "delta": {{"role": "assistant", "content": "dummy"}}}}]}}')
    assert re.sub(r'"created": \d+', '"created": T', re.sub(ID, "ID", event[len("data: "):])) == expected
  assert len(ids) == 1


@pytest.mark.asyncio
async def test_stream_usage_on_final_chunk_when_asked(server):
  _, _, text = await post(f"{server.url}/chat/completions", {"messages": USER, "stream": True, "stream_options": {"include_usage": True}})
  bodies = [json.loads(e[6:]) for e in events_of(text)]
  assert all("usage" not in b for b in bodies[:-1])
  assert bodies[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 10, "total_tokens": 11}
  assert bodies[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("model", [None, "", "gpt-4o", "gpt-3.5-turbo", "dummy"])
@pytest.mark.asyncio
async def test_model_fallbacks_resolve_to_default(server, model):
  body = {"messages": USER} if model == "" else {"model": model, "messages": USER}
  status, _, text = await post(f"{server.url}/v1/chat/completions", body)
  assert status == 200 and json.loads(text)["model"] == "dummy"


@pytest.mark.parametrize("model", ["no-such-model", "llama-3.2-1b"])
@pytest.mark.asyncio
async def test_unknown_or_unrunnable_model_is_400_listing_supported(server, model):
  error = error_of(*await post(f"{server.url}/v1/chat/completions", {"model": model, "messages": USER}))
  assert error == {"message": f"Unsupported model: {model} with inference engine DummyInferenceEngine. Supported models for this engine: ['dummy']",
                   "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


@pytest.mark.asyncio
async def test_token_encode(server):
  status, _, text = await post(f"{server.url}/v1/chat/token/encode", {"messages": USER})
  assert status == 200
  assert text == '{"length": 22, "num_tokens": 1, "encoded_tokens": [1], "encoded_prompt": "dummy_tokenized_prompt"}'
  status, _, _ = await post(f"{server.url}/chat/token/encode", {})
  assert status == 200
  error = error_of(*await post(f"{server.url}/v1/chat/token/encode", {"messages": USER, "tools": "x"}))
  assert error["param"] == "tools"
  error = error_of(*await post(f"{server.url}/v1/chat/token/encode", {"messages": [{"role": "wizard", "content": "x"}]}))
  assert error["param"] == "messages[0].role"


# --- bad input: 400 with an OpenAI-style error naming the field ---

BAD_VALUES = [
  ({"temperature": 2.5}, "temperature must be a number between 0 and 2"),
  ({"temperature": -0.1}, "temperature must be a number between 0 and 2"),
  ({"temperature": "hot"}, "temperature must be a number between 0 and 2"),
  ({"temperature": True}, "temperature must be a number between 0 and 2"),
  ({"temperature": 10**400}, "temperature must be a number between 0 and 2"),
  ({"top_p": 1.5}, "top_p must be a number between 0 and 1"),
  ({"min_p": -1}, "min_p must be a number between 0 and 1"),
  ({"top_k": -3}, "top_k must be an integer >= 0"),
  ({"top_k": 2.5}, "top_k must be an integer >= 0"),
  ({"top_k": 1e29}, "top_k must be an integer >= 0"),
  ({"top_k": 10**29}, "top_k must be an integer >= 0"),
  ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
  ({"max_tokens": "10"}, "max_tokens must be an integer >= 1"),
  ({"max_tokens": 1e23}, "max_tokens must be an integer >= 1"),
  ({"max_tokens": 10**23}, "max_tokens must be an integer >= 1"),
  ({"max_completion_tokens": -5}, "max_completion_tokens must be an integer >= 1"),
  ({"seed": 1.5}, "seed must be an integer"),
  ({"seed": "42"}, "seed must be an integer"),
  ({"stop": 42}, "stop must be a non-empty string or a list"),
  ({"stop": ["a", ""]}, "stop must be a non-empty string or a list"),
  ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
  ({"n": 0}, "n must be an integer between 1 and 16"),
  ({"n": 17}, "n must be an integer between 1 and 16"),
  ({"n": True}, "n must be an integer between 1 and 16"),
  ({"n": 1.0}, "n must be an integer between 1 and 16"),
  ({"logprobs": "yes"}, "logprobs must be true or false"),
  ({"logprobs": 1}, "logprobs must be true or false"),
  ({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be an integer between 0 and 20"),
  ({"top_logprobs": -1, "logprobs": True}, "top_logprobs must be an integer between 0 and 20"),
  ({"top_logprobs": 2.0, "logprobs": True}, "top_logprobs must be an integer between 0 and 20"),
  ({"top_logprobs": 5}, "top_logprobs needs logprobs set to true"),
  ({"top_logprobs": 0, "logprobs": False}, "top_logprobs needs logprobs set to true"),
  ({"stream": "yes"}, "stream must be true or false"),
  ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
  ({"stream_options": {"include_usage": True, "continuous": True}}, "stream_options"),
  ({"tools": {"name": "x"}}, "tools must be a list"),
  ({"tool_choice": "required"}, 'tool_choice "required" needs tools'),
  ({"model": 7}, "model must be a string"),
  ({"user": 7}, "user must be a string"),
  ({"messages": []}, "messages is required"),
  ({"messages": "hello"}, "messages is required"),
  ({"messages": [{"content": "no role"}]}, "messages[0] must be an object"),
  ({"messages": [{"role": "user"}]}, "messages[0] must be an object"),
  ({"messages": [{"role": "wizard", "content": "abracadabra"}]}, "messages[0].role must be one of"),
  ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be a string or a list"),
  ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0]"),
  ({"frequency_penalty": 99}, "frequency_penalty must be a number between -2 and 2"),
  ({"presence_penalty": "x"}, "presence_penalty must be a number between -2 and 2"),
  ({"repetition_penalty": 0}, "repetition_penalty must be a number between 0.01 and 10"),
  ({"min_tokens": 50, "max_tokens": 10}, "min_tokens must be an integer >= 0 and at most the token budget"),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}}, "is not a valid JSON Schema"),
  ({"response_format": "json"}, "response_format must be an object"),
  ({"logit_bias": {"42": 500}}, "logit_bias['42'] must be a number between -100 and 100"),
  ({"logit_bias": {"x": 5}}, "logit_bias keys must be token ids"),
  ({"logit_bias": {"99999999": 5}}, "logit_bias names token 99999999, which this model does not have"),
  # Parameters this server does not implement are refused, never silently ignored.
  ({"best_of": 3}, "Unrecognized request argument supplied: best_of"),
  ({"temprature": 0.5}, "Unrecognized request argument supplied: temprature"),
]


@pytest.mark.parametrize("change,message", BAD_VALUES)
@pytest.mark.asyncio
async def test_bad_values_are_400_naming_the_field(server, change, message):
  error = error_of(*await post(f"{server.url}/v1/chat/completions", {"model": "dummy", "messages": USER, **change}))
  assert message in error["message"] and error["type"] == "invalid_request_error"
  assert error["param"].startswith(next(iter(change))), error


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("raw,message,param", [
  ("{not json", "Invalid JSON body", None), ("[1, 2]", "must be a JSON object", None), ("", "Invalid JSON body", None),
  ('{"model": "dummy"}', "messages is required", "messages"),
  (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', "not valid UTF-8 (invalid continuation byte at byte 46)", None),
  ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content contains a lone surrogate", "messages[0].content"),
  ('{"messages": [{"role": "user", "content": "ok"}], "stop": ["\\udfff"]}', "stop[0] contains a lone surrogate", "stop[0]"),
  ('{"messages": ' + DEEP + '}', "nested too deeply", None),
  ('{"messages": [{"role": "user", "content": "hi"}], "tools": ' + "[" * 80 + "]" * 80 + '}', "nested too deeply", "tools"),
])
@pytest.mark.asyncio
async def test_malformed_bodies_are_400_json(server, raw, message, param):
  error = error_of(*await post(f"{server.url}/v1/chat/completions", raw, raw=True))
  assert message in error["message"] and (param is None or error["param"].startswith(param)), error


@pytest.mark.asyncio
async def test_accepted_edge_values(server):
  # Limits of each range, nulls meaning "default", a list-of-parts message with an image, a negative seed, and the
  # values of unimplemented parameters that ask for nothing.
  body = {"model": None, "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "max_tokens": None, "seed": -1, "stop": None, "n": 1,
          "stream": None, "logprobs": False, "top_logprobs": None, "frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1,
          "logit_bias": {}, "min_tokens": 0, "response_format": {"type": "text"},
          "tool_choice": "auto", "user": "someone", "stream_options": None,
          "messages": [{"role": "developer", "content": "be brief"},
                       {"role": "user", "content": [{"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "data:x"}}]}]}
  status, _, text = await post(f"{server.url}/v1/chat/completions", body)
  assert status == 200, text


@pytest.mark.asyncio
async def test_unknown_routes_and_methods(server):
  error = error_of(*await post(f"{server.url}/v1/models", {}), expected_status=405)
  assert error["message"] == "POST is not allowed on /v1/models"
  error = error_of(*await get(f"{server.url}/no/such/page"), expected_status=404)
  assert error["type"] == "not_found_error"


# --- other routes ---

@pytest.mark.asyncio
async def test_models_and_initial_models(server):
  for path in ("/v1/models", "/models"):
    status, _, text = await get(f"{server.url}{path}")
    assert status == 200
    body = json.loads(text)
    assert list(body) == ["object", "data"] and body["object"] == "list"
    assert [m["id"] for m in body["data"]] == list(model_cards) + list(embedding_cards)
    embedding = {m["id"]: m for m in body["data"] if m.get("type") == "embedding"}
    assert embedding["all-minilm-l6-v2"] == {"id": "all-minilm-l6-v2", "object": "model", "owned_by": "exo", "ready": True, "type": "embedding"}
    assert isinstance(embedding["qwen3-embedding-0.6b"]["ready"], bool)  # downloaded or not yet (on its first request)
    assert body["data"][0] == {"id": list(model_cards)[0], "object": "model", "owned_by": "exo", "ready": True}
  status, _, text = await get(f"{server.url}/initial_models")
  assert status == 200
  assert text == '{"dummy": {"name": "Dummy", "downloaded": null, "download_percentage": null, "total_size": null, "total_downloaded": null, "loading": true}}'


@pytest.mark.asyncio
async def test_modelpool_with_dummy_engine_is_only_done(server):
  status, headers, text = await get(f"{server.url}/modelpool")
  assert status == 200 and headers["Content-Type"] == "text/event-stream" and headers["Connection"] == "keep-alive"
  assert text == "data: [DONE]\n\n"


@pytest.mark.asyncio
async def test_download_routes(server):
  url = f"{server.url}/download"
  error = error_of(*await post(url, {}))
  assert error["message"].startswith("model is required") and error["param"] == "model"
  error = error_of(*await post(url, {"model": ["dummy"]}))
  assert error["message"].startswith("model is required")
  error = error_of(*await post(url, {"model": "nope"}), expected_status=404)
  assert error == {"message": f"Invalid model: nope. Supported models: {list(model_cards)}", "type": "not_found_error", "param": "model",
                   "code": "model_not_found"}
  error = error_of(*await post(url, {"model": "llama-3.2-1b"}))
  assert error["message"].startswith("Could not build shard for model llama-3.2-1b") and error["code"] == "model_not_supported"
  status, _, text = await post(url, {"model": "dummy"})
  assert (status, text) == (200, '{"status": "success", "message": "Download started for model: dummy"}')


@pytest.mark.asyncio
async def test_download_progress_lists_only_in_progress(server):
  assert (await get(f"{server.url}/v1/download/progress"))[2] == "{}"
  shard = Shard("dummy", 0, 7, 8)
  running = RepoProgressEvent(shard, "dummy", "main", 1, 4, 50, 50, 200, 10.0, 15.0, {}, "in_progress")
  done = RepoProgressEvent(shard, "dummy", "main", 4, 4, 200, 200, 200, 0.0, 0.0, {}, "complete")
  server.node.node_download_progress.update({"peer-a": running, "peer-b": done})
  server.node.node_download_sources["peer-a"] = {"w.safetensors": "peer peer-b"}
  try:
    status, _, text = await get(f"{server.url}/v1/download/progress")
    assert status == 200 and json.loads(text) == {"peer-a": {**running.to_dict(), "file_sources": {"w.safetensors": "peer peer-b"}}}
  finally:
    server.node.node_download_progress.clear()
    server.node.node_download_sources.clear()


@pytest.mark.asyncio
async def test_delete_model(server):
  async with aiohttp.ClientSession() as session:
    for model, status, message in [("dummy", 404, "Model dummy files not found"), ("llama-3.2-1b", 400, "model llama-3.2-1b has no files for"),
                                   ("no-such-model", 404, "Invalid model: no-such-model")]:
      async with session.delete(f"{server.url}/models/{model}") as r:
        error = error_of(r.status, r.headers, await r.text(), expected_status=status)
        assert error["message"].startswith(message) and error["param"] == "model_name", error


@pytest.mark.asyncio
async def test_topology_healthcheck_and_image_routes(server):
  for path in ("/v1/topology", "/topology"):
    status, _, text = await get(f"{server.url}{path}")
    body = json.loads(text)
    # Upstream's keys as upstream orders them; this fork adds the placement after them (docs/placement.md).
    assert status == 200 and list(body) == ["nodes", "peer_graph", "active_node_id", "placement"] and "api-test-node" in body["nodes"]
    assert list(body["nodes"]["api-test-node"]) == ["model", "chip", "memory", "flops"]
  assert (await get(f"{server.url}/healthcheck"))[2] == '{"status": "ok"}'
  error = error_of(*await post(f"{server.url}/v1/image/generations", {"model": "stable-diffusion-2-1-base", "prompt": "a cat"}))
  assert error["message"] == "Unsupported model: stable-diffusion-2-1-base with inference engine DummyInferenceEngine"
  assert error_of(*await post(f"{server.url}/create_animation", {}))["param"] == "replacement_image_path"
  error = error_of(*await post(f"{server.url}/create_animation", {"replacement_image_path": "/tmp/x.png"}), expected_status=501)
  assert error["type"] == "not_implemented_error"


# --- timeouts, failures, isolation ---

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.asyncio
async def test_timeout_before_first_token_is_504(make_server, stream):
  s = make_server(SlowEngine(delay=5), response_timeout=1)
  error = error_of(*await post(f"{s.url}/v1/chat/completions", {"messages": USER, "stream": stream}), expected_status=504)
  assert error["message"] == "the reply took longer than this node's response timeout of 1 s (--chatgpt-api-response-timeout)"
  assert (error["type"], error["code"]) == ("timeout_error", "response_timeout")


@pytest.mark.asyncio
async def test_timeout_during_the_prompt_leaves_nothing_behind(make_server):
  s = make_server(SlowEngine(delay=2), response_timeout=0.5)
  assert (await post(f"{s.url}/v1/chat/completions", {"messages": USER}))[0] == 504
  # The engine step in flight finishes, then the request must be gone.
  await eventually(lambda: s.node.outstanding_requests == {} and len(s.node.requests) == 0)


@pytest.mark.asyncio
async def test_timeout_after_headers_ends_the_stream_with_an_error_event(make_server):
  s = make_server(SlowEngine(delay=5, fast=3), response_timeout=1.5)
  status, _, text = await post(f"{s.url}/v1/chat/completions", {"messages": USER, "stream": True})
  bodies = [json.loads(e[6:]) for e in events_of(text)]
  assert status == 200 and 2 <= len(bodies) <= 4
  assert all(b["choices"][0]["finish_reason"] is None and "error" not in b for b in bodies[:-1])
  last = bodies[-1]
  assert last["choices"][0]["finish_reason"] == "error" and last["choices"][0]["delta"]["content"] == ""
  assert last["error"] == {"message": "the reply took longer than this node's response timeout of 1.5 s (--chatgpt-api-response-timeout)",
                           "type": "timeout_error", "param": None, "code": "response_timeout"}
  client = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="exo", max_retries=0)
  with pytest.raises(openai.APIError, match="response timeout of 1.5 s"):
    async for _ in await client.chat.completions.create(model="dummy", messages=USER, stream=True):
      pass
  await client.close()


@pytest.mark.asyncio
async def test_engine_failure_ends_request_with_error(make_server):
  s = make_server(FailingEngine())
  error = error_of(*await post(f"{s.url}/v1/chat/completions", {"messages": USER}), expected_status=500)
  assert error["message"].startswith("Error processing prompt (see logs with DEBUG>=2):") and "engine exploded" in error["message"]
  assert (error["type"], error["code"]) == ("server_error", "generation_failed")
  status, _, text = await post(f"{s.url}/v1/chat/completions", {"messages": USER, "stream": True})
  events = [json.loads(e[6:]) for e in events_of(text)]
  assert status == 200 and events[-1]["error"]["message"].endswith("engine exploded") and events[-1]["choices"][0]["finish_reason"] == "error"
  assert all(e["choices"][0]["finish_reason"] is None for e in events[:-1])
  # The official client turns that error event into an exception instead of a silently short answer.
  client = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="exo", max_retries=0)
  with pytest.raises(openai.APIError, match="engine exploded"):
    async for _ in await client.chat.completions.create(model="dummy", messages=USER, stream=True):
      pass
  await client.close()


async def test_a_non_stream_client_that_goes_away_cancels_its_generation(make_server):
  """A client asks for 1,000 tokens (about 50 s) without streaming and drops its connection once tokens flow, as a
  client process that dies does: the handler is cancelled with its connection, the ring stops generating within a
  few tokens, and the place is freed."""
  s = make_server(SlowEngine(delay=0.05))
  tokens = {}

  def count(request_id, new_tokens, is_finished):
    tokens[request_id] = tokens.get(request_id, 0) + len(new_tokens)
  s.node.on_token.register("test-counter").on_next(count)
  body = json.dumps({"messages": USER, "max_tokens": 1000, "ignore_eos": True}).encode()
  _, writer = await asyncio.open_connection("127.0.0.1", s.port)
  writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
  await writer.drain()
  try:
    await eventually(lambda: any(n >= 5 for n in tokens.values()), 30, "tokens flowing")
  finally:
    writer.transport.abort()  # the connection drops at once, unread reply and all
  request_id = next(iter(tokens))
  await eventually(lambda: s.node.requests.ended(request_id) is Status.CANCELLED, 20, lambda: f"its generation cancelled: {tokens}")
  assert tokens[request_id] < 100, tokens
  await eventually(lambda: s.api.admission.running == 0 and s.api.admission.held == 0, 5)


@pytest.mark.asyncio
async def test_quit_replies_then_signals(make_server):
  s = make_server("dummy")
  status, _, text = await post(f"{s.url}/quit", {})
  assert (status, text) == (200, '{"detail": "Quit signal received"}')
  assert s.quit_requested.wait(5)


@pytest.mark.asyncio
async def test_concurrent_requests_are_isolated_from_bad_ones(server):
  good = [post(f"{server.url}/v1/chat/completions", {"messages": USER, "stream": i % 2 == 0, "max_tokens": 3 + i}) for i in range(8)]
  bad = [post(f"{server.url}/v1/chat/completions", b, raw=True) for b in ("{", '{"messages": 1}', '{"messages": [], "top_k": -1}')]
  results = await asyncio.gather(*good, *bad)
  for i, (status, _, text) in enumerate(results[:8]):
    assert status == 200
    if i % 2 == 0:
      bodies = [json.loads(e[6:]) for e in events_of(text)]
      assert "".join(b["choices"][0]["delta"]["content"] for b in bodies) == "dummy" * min(3 + i, 10)
    else:
      assert json.loads(text)["usage"]["completion_tokens"] == min(3 + i, 10)
  assert all(status == 400 for status, _, _ in results[8:])


# --- reply text: incremental decoding and stop strings (no server) ---

def fake_tokenizer(pieces):
  """Token i decodes to pieces[i]; pieces may be bytes so multi-byte characters can split across tokens; "<eos>" is a
  special token."""
  def decode(tokens, skip_special_tokens=False):
    kept = [pieces[t] for t in tokens if not (skip_special_tokens and pieces[t] == "<eos>")]
    raw = b"".join(p if isinstance(p, bytes) else p.encode() for p in kept)
    return raw.decode("utf-8", errors="replace")
  return decode


def run(reply, tokens, eos=None):
  chunks = []
  for i, t in enumerate(tokens):
    finished = i == len(tokens) - 1
    chunks.append(reply.feed([t], finished))
    if reply.finish_reason:
      break
  return chunks


def test_stop_string_split_across_tokens_is_cut_and_never_leaks():
  pieces = ["Hello", " wor", "ld", "!", " More", "<eos>"]
  reply = ReplyText(fake_tokenizer(pieces), {5}, stop=["world!"])
  chunks = run(reply, [0, 1, 2, 3, 4, 5])
  assert reply.text == "Hello " and reply.finish_reason == "stop"
  assert chunks[-1][-1] == "" and not any("wor" in c for cs in chunks for c in cs)
  assert len(reply.tokens) == 4  # generation stopped at the token that completed the stop string


def test_held_text_that_is_not_a_stop_string_is_released():
  reply = ReplyText(fake_tokenizer(["a", "wo", "x", "<eos>"]), {3}, stop=["wor"])
  chunks = run(reply, [0, 1, 2, 3])
  assert chunks[:3] == [["a"], [""], ["wox"]] and chunks[3] == [""]  # the end token counts but adds no text
  assert reply.text == "awox" and reply.finish_reason == "stop" and len(reply.tokens) == 4


def test_final_chunk_carries_the_held_text_and_never_the_end_tokens():
  reply = ReplyText(fake_tokenizer(["Par", "is", "<eos>"]), {2}, stop=["Paris!"])
  chunks = run(reply, [0, 1, 2])
  assert chunks == [[""], [""], ["Paris"]] and reply.finish_reason == "stop"
  reply = ReplyText(fake_tokenizer(["Par", "is", "}"]), set(), complete=lambda tokens: tokens == [0, 1, 2])
  assert run(reply, [0, 1, 2]) == [["Par"], ["is"], ["}"]] and reply.finish_reason == "stop"  # a completed grammar
  reply = ReplyText(fake_tokenizer(["Par", "is", "}"]), set(), complete=lambda tokens: False)
  assert run(reply, [0, 1, 2])[-1] == ["}"] and reply.finish_reason == "length"


def test_multibyte_character_split_across_tokens_waits_for_its_last_byte():
  euro = "€".encode()
  reply = ReplyText(fake_tokenizer(["a", euro[:1], euro[1:2], euro[2:], "b"]), set(), stop=[])
  chunks = run(reply, [0, 1, 2, 3, 4])
  assert chunks == [["a"], [""], [""], ["€"], ["b"]] and reply.finish_reason == "length"


def test_length_finish_and_stop_matching_inside_the_last_token():
  reply = ReplyText(fake_tokenizer(["one", " two", " three"]), set())
  assert run(reply, [0, 1, 2]) == [["one"], [" two"], [" three"]] and reply.finish_reason == "length"
  reply = ReplyText(fake_tokenizer(["one", " two", " three"]), set(), stop=["thr"])
  assert run(reply, [0, 1, 2]) == [["one"], [" two"], [" ", ""]] and reply.finish_reason == "stop"

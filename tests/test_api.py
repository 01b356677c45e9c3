"""The API driven by the official `openai` client against the real SmolLM2-135M on the numpy engine: streaming and
not, each request's own sampling parameters, exact max_tokens, stop strings, seeds, disconnects."""
import asyncio
import concurrent.futures
import json

import aiohttp
import openai
import pytest

from tests.support.api_server import shared_server
from tests.support.waiting import eventually

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Tell me a short story about a dragon."}]


@pytest.fixture(scope="module")
def server():
  return shared_server("numpy")


@pytest.fixture(scope="module")
def greedy_france(client):
  return client.chat.completions.create(model=MODEL, messages=FRANCE)


def test_non_stream_answer_and_usage(server, client, greedy_france):
  r = greedy_france
  assert r.object == "chat.completion" and r.model == MODEL and r.system_fingerprint == "exo_0.0.1"
  choice = r.choices[0]
  assert "Paris" in choice.message.content and choice.message.role == "assistant"
  assert choice.finish_reason == "stop" and "<|im_end|>" not in choice.message.content  # upstream appends the end token's text; not here
  tokenizer = server.call(server.api.tokenizer_for(MODEL))
  prompt = tokenizer.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
  assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
  assert r.usage.completion_tokens == len(tokenizer.encode(choice.message.content, add_special_tokens=False)) + 1  # the end token counts
  assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_non_stream_and_carries_usage(client, greedy_france):
  chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, stream=True, stream_options={"include_usage": True}))
  assert "".join(c.choices[0].delta.content for c in chunks) == greedy_france.choices[0].message.content
  assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
  assert chunks[-1].choices[0].delta.content == ""  # the last chunk carries the end token, whose text is not the answer's
  assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == len(chunks)
  assert chunks[-1].usage.prompt_tokens == greedy_france.usage.prompt_tokens
  assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_gpt_model_names_fall_back_to_default(client, greedy_france):
  r = client.chat.completions.create(model="gpt-4o-mini", messages=FRANCE, max_tokens=4)
  assert r.model == MODEL and greedy_france.choices[0].message.content.startswith(r.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_cuts_at_exactly_that_many(client, stream):
  if stream:
    chunks = list(client.chat.completions.create(model=MODEL, messages=STORY, max_completion_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    assert len(chunks) == 5 and chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].choices[0].delta.content  # a "length" finish carries a real last token
  else:
    r = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=7)
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


def test_stop_string_cuts_text_and_stops_generation(client, greedy_france):
  full = greedy_france.choices[0].message.content  # "The capital of France is Paris.<|im_end|>"
  r = client.chat.completions.create(model=MODEL, messages=FRANCE, stop=["Paris", "never appears"])
  assert r.choices[0].message.content == full[:full.index("Paris")] and r.choices[0].finish_reason == "stop"
  assert r.usage.completion_tokens < greedy_france.usage.completion_tokens  # it stopped at the stop string
  chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, stop=" France", stream=True))
  text = "".join(c.choices[0].delta.content for c in chunks)
  assert text == full[:full.index(" France")] and "France" not in text
  assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].delta.content == ""


def test_seed_reproduces_sampling_at_positive_temperature(client):
  def sample(seed):
    return client.chat.completions.create(model=MODEL, messages=STORY, temperature=1.3, seed=seed, max_tokens=10).choices[0].message.content
  first = sample(1234)
  assert sample(1234) == first
  assert sample(99) != first


def test_sampling_filters_are_honoured(client):
  greedy = client.chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=6).choices[0].message.content
  # At a wild temperature each filter below leaves only the most likely token, so the answer must be the greedy one.
  for narrow in ({"top_p": 0.0}, {"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}}):
    r = client.chat.completions.create(model=MODEL, messages=STORY, temperature=2.0, max_tokens=6, **narrow)
    assert r.choices[0].message.content == greedy, narrow
  wild = {client.chat.completions.create(model=MODEL, messages=STORY, temperature=2.0, seed=s, max_tokens=6).choices[0].message.content for s in (1, 2)}
  assert wild != {greedy}


def test_bad_parameter_raises_bad_request_in_the_client(client):
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=3)
  assert e.value.status_code == 400 and e.value.body == {"message": "temperature must be a number between 0 and 2", "type": "invalid_request_error",
                                                         "param": "temperature", "code": None}
  with pytest.raises(openai.BadRequestError) as e:
    client.chat.completions.create(model="llama-9000", messages=FRANCE)
  assert "Supported models for this engine: ['smollm2-135m'" in e.value.body["message"] and e.value.code == "model_not_found"


def test_concurrent_requests_each_get_their_own_parameters(client):
  def ask(n):
    return client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=n).usage.completion_tokens
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    assert list(pool.map(ask, [2, 4, 6])) == [2, 4, 6]


@pytest.mark.asyncio
async def test_client_disconnect_cancels_generation(server):
  """Unstopped, this story runs to max_tokens (300); a client that hangs up must end it within a token or two."""
  counts = {}
  counter = server.node.on_token.register("test-disconnect-counter")
  counter.on_next(lambda request_id, tokens, is_finished: counts.__setitem__(request_id, counts.get(request_id, 0) + len(tokens)))
  body = {"model": MODEL, "messages": STORY, "max_tokens": 300}
  try:
    async with aiohttp.ClientSession() as session:
      async with session.post(f"{server.url}/v1/chat/completions", json={**body, "stream": True}) as r:
        first = await r.content.readuntil(b"\n\n")
        assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
        r.close()  # hang up mid-stream
    await eventually(lambda: not server.node.outstanding_requests, 60, lambda: f"no request left: {server.node.outstanding_requests}")
    async with aiohttp.ClientSession() as session:  # a non-stream request whose client leaves once tokens flow
      waiting = asyncio.create_task(session.post(f"{server.url}/v1/chat/completions", json=body))
      await eventually(lambda: len(counts) >= 2, 60)  # its tokens flow
      waiting.cancel()
    await eventually(lambda: not server.node.outstanding_requests, 60, lambda: f"no request left: {server.node.outstanding_requests}")
    assert all(n < 30 for n in counts.values()), counts
  finally:
    server.node.on_token.deregister("test-disconnect-counter")

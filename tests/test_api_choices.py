"""What the official `openai` client sends beyond one plain answer: logprobs / top_logprobs, n choices, and the legacy
/v1/completions route; against the real SmolLM2-135M on the numpy engine (one in-thread node), streaming and not.
Bad values of these fields are 400s naming the field (on the dummy engine, where nothing needs a model)."""

import aiohttp
import openai
import pytest

from exo.api.settings import ApiSettings
from exo.inference.tokenizers import resolve_tokenizer
from tests.support.api_server import SlowEngine, eventually, shared_server

MODEL = "smollm2-135m"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
  return shared_server("numpy")


def check_chat_logprobs(entries, top_n):
  for entry in entries:
    assert entry.logprob <= 0 and len(entry.top_logprobs) == top_n
    assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob  # greedy: top-1
    assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    assert all(t.logprob <= 0 and bytes(t.bytes).decode() == t.token for t in entry.top_logprobs)


# --- logprobs ---

def test_chat_logprobs_one_entry_per_token_greedy_is_top_1(client):
  reply = client.chat.completions.create(model=MODEL, messages=FRANCE, logprobs=True, top_logprobs=3, max_tokens=12)
  entries = reply.choices[0].logprobs.content
  assert len(entries) == reply.usage.completion_tokens
  check_chat_logprobs(entries, 3)
  assert "".join(e.token for e in entries).startswith(reply.choices[0].message.content.removesuffix("<|im_end|>"))
  # Streamed, each chunk carries the entries of its tokens: the same ones.
  chunks = list(client.chat.completions.create(model=MODEL, messages=FRANCE, logprobs=True, top_logprobs=3, max_tokens=12, stream=True))
  streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
  assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]
  check_chat_logprobs(streamed, 3)
  # Without top_logprobs: the token's own logprob, no alternatives; without logprobs: none at all.
  plain = client.chat.completions.create(model=MODEL, messages=FRANCE, logprobs=True, max_tokens=4).choices[0].logprobs.content
  assert [e.top_logprobs for e in plain] == [[]] * 4 and [e.token for e in plain] == [e.token for e in entries[:4]]
  assert client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2).choices[0].logprobs is None


def test_logprobs_are_of_the_distribution_after_temperature(client):
  def first(**kw):
    return client.chat.completions.create(model=MODEL, messages=FRANCE, logprobs=True, top_logprobs=5, max_tokens=1, seed=1, **kw).choices[0].logprobs.content[0]
  cold, greedy = first(temperature=0.3), first(temperature=0)
  assert [t.token for t in cold.top_logprobs] == [t.token for t in greedy.top_logprobs]
  assert cold.top_logprobs[0].logprob > greedy.top_logprobs[0].logprob  # a colder distribution is sharper
  assert cold.top_logprobs[-1].logprob < greedy.top_logprobs[-1].logprob


# --- n ---

def test_n_choices_each_with_its_own_seeded_stream(client):
  ask = dict(model=MODEL, messages=FRANCE, temperature=1.0, max_tokens=8, seed=11)
  reply = client.chat.completions.create(n=3, **ask)
  assert [c.index for c in reply.choices] == [0, 1, 2]
  texts = [c.message.content for c in reply.choices]
  assert len(set(texts)) > 1  # three random streams, not one
  # Choice i is what seed + i gives alone.
  assert client.chat.completions.create(**{**ask, "seed": 12}).choices[0].message.content == texts[1]
  chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **ask))
  by_index = {}
  for c in chunks:
    by_index.setdefault(c.choices[0].index, []).append(c.choices[0])
  assert sorted(by_index) == [0, 1, 2]
  assert ["".join(p.delta.content or "" for p in by_index[i]) for i in range(3)] == texts
  assert all([p.finish_reason for p in parts if p.finish_reason] == [parts[-1].finish_reason] for parts in by_index.values())
  assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens and all(c.usage is None for c in chunks[:-1])


def test_n_with_logprobs(client):
  reply = client.chat.completions.create(model=MODEL, messages=FRANCE, n=2, logprobs=True, top_logprobs=2, max_tokens=5)
  assert [c.index for c in reply.choices] == [0, 1]
  assert reply.choices[0].message.content == reply.choices[1].message.content  # greedy: both choices alike
  for choice in reply.choices:
    assert len(choice.logprobs.content) == 5
    check_chat_logprobs(choice.logprobs.content, 2)


# --- /v1/completions ---

def test_completions_answer_streaming_and_not(client, smollm2_path):
  reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
  assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
  assert reply.usage.completion_tokens == 5 and reply.usage.prompt_tokens == 5
  text = reply.choices[0].text
  assert text.strip().startswith("Paris")
  chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == text and chunks[-1].choices[0].finish_reason == "length"
  # The same prompt as token ids, and echoed.
  ids = resolve_tokenizer(smollm2_path).encode(PROMPT)
  assert client.completions.create(model=MODEL, prompt=ids, max_tokens=5).choices[0].text == text
  assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, echo=True).choices[0].text == PROMPT + text
  # The default is OpenAI's: 16 tokens.
  assert client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"ignore_eos": True}).usage.completion_tokens == 16


def test_completions_logprobs_and_several_prompts(client):
  reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2)
  lp = reply.choices[0].logprobs
  assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
  assert "".join(lp.tokens) == reply.choices[0].text
  assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
  assert all(v <= 0 and len(top) == 2 and max(top.values()) == v and top[t] == v for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
  reply = client.completions.create(model=MODEL, prompt=[PROMPT, "One, two, three,"], n=2, max_tokens=3)
  assert [c.index for c in reply.choices] == [0, 1, 2, 3]
  texts = [c.text for c in reply.choices]
  assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0] != texts[2]
  assert reply.usage.completion_tokens == 12


# --- bad values (dummy engine) ---

@pytest.fixture(scope="module")
def dummy():
  return shared_server("dummy")


async def post(url, body):
  async with aiohttp.ClientSession() as session:
    async with session.post(url, json=body) as r:
      return r.status, await r.json()


COMPLETION_BAD_VALUES = [
  ({}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ["ok", ""]}, "prompt[1]"),
  ({"prompt": ["ok", 3]}, "prompt[1]"), ({"prompt": [1, -2]}, "prompt"), ({"prompt": [1, True]}, "prompt"), ({"prompt": [[1], [2, "x"]]}, "prompt[1]"),
  ({"prompt": [[]]}, "prompt[0]"), ({"prompt": [5, 1000]}, "prompt"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
  ({"prompt": "x", "logprobs": True}, "logprobs"), ({"prompt": "x", "logprobs": 2, "echo": True}, "logprobs"), ({"prompt": "x", "n": 0}, "n"),
  ({"prompt": "x", "n": 17}, "n"), ({"prompt": ["a"] * 9, "n": 2}, "n"), ({"prompt": ["a"] * 17}, "prompt"), ({"prompt": "x", "echo": "yes"}, "echo"),
  ({"prompt": "x", "max_completion_tokens": 5}, "max_completion_tokens"), ({"prompt": "x", "suffix": "y"}, "suffix"),
  ({"prompt": "x", "best_of": 3}, "best_of"), ({"prompt": "x", "messages": []}, "messages"),
]


@pytest.mark.parametrize("body,param", COMPLETION_BAD_VALUES)
@pytest.mark.asyncio
async def test_bad_completion_values_are_400_naming_the_field(dummy, body, param):
  status, reply = await post(f"{dummy.url}/v1/completions", {"model": "dummy", **body})
  assert status == 400 and reply["error"]["param"] == param, reply


@pytest.mark.asyncio
async def test_bad_completion_values_are_400_through_the_client(dummy):
  async with openai.AsyncOpenAI(base_url=f"{dummy.url}/v1", api_key="exo", max_retries=0) as client:
    for kwargs, param in [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"n": 0}, "n"), ({"n": 17}, "n")]:
      with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="dummy", messages=FRANCE, **kwargs)
      assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
      await client.completions.create(model="dummy", prompt="x", logprobs=3, echo=True)
    assert e.value.body["param"] == "logprobs"


# --- admission ---

@pytest.mark.asyncio
async def test_each_choice_takes_a_place_and_leaves_it_when_it_ends(make_server):
  s = make_server(SlowEngine(delay=0.02), settings=ApiSettings(max_running=1, max_queued=2))
  url = f"{s.url}/v1/chat/completions"
  status, reply = await post(url, {"model": "dummy", "messages": FRANCE, "n": 4})
  assert status == 400 and reply["error"]["param"] == "n" and "at most 3 requests" in reply["error"]["message"]
  # Three choices over one running place: they run one after another, none waits for a place another holds.
  status, reply = await post(url, {"model": "dummy", "messages": FRANCE, "n": 3})
  assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1, 2]
  assert all(c["message"]["content"] == "dummy" * 10 for c in reply["choices"])
  assert s.api.admission.held == 0 and s.api.admission.running == 0


@pytest.mark.asyncio
async def test_a_client_leaving_ends_every_choice(make_server):
  s = make_server(SlowEngine(delay=0.2))
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{s.url}/v1/chat/completions", json={"model": "dummy", "messages": FRANCE, "n": 3, "stream": True}) as r:
      assert r.status == 200
      await r.content.readline()  # the first chunk
      await eventually(lambda: len(s.node.requests) == 3)
  await eventually(lambda: len(s.node.requests) == 0 and s.api.admission.held == 0)

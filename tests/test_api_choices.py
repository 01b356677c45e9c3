"""What the official `openai` client sends beyond one plain answer: logprobs / top_logprobs, n choices, and the legacy
/v1/completions route; against the real SmolLM2-135M on the numpy engine (one in-thread node), streaming and not.
(Bad values of these fields, and the places choices take: test_api_choice_checks.py.)"""
import pytest

from exo.inference.tokenizers import resolve_tokenizer
from tests.support.api_server import shared_server

pytestmark = pytest.mark.model

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

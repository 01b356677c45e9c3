"""The sampling controls clients send, against a real node (SmolLM2 on the numpy engine, batching on): greedy answers
with penalties and a logit_bias equal those computed here on the model's own logits with the definitions applied
token by token, all in one batch with a request that asks for none; Ollama's options (repeat_penalty with its window,
num_predict, num_ctx, top_k, top_p, min_p, seed, stop) honoured; min_tokens holds the end token off."""
import asyncio

import aiohttp
import numpy as np
import pytest

from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from tests.support.models import SMOLLM2, smollm2_shard

pytestmark = pytest.mark.model

PROMPT = "<|im_start|>user\nWrite the word apple ten times.<|im_end|>\n<|im_start|>assistant\n"
STEPS = 16


@pytest.fixture(scope="module")
def server(numpy_server):
  return numpy_server


@pytest.fixture(scope="module")
def engine(downloader):
  eng = NumpyDynamicShardInferenceEngine(downloader)
  asyncio.run(eng.ensure_shard(smollm2_shard()))
  return eng


def processed(logits, prompt, answer, body):
  """The definitions, token by token: Hugging Face's repetition penalty over prompt and answer, OpenAI's frequency
  and presence penalties over the answer, then the logit_bias (-100 bans)."""
  out = logits.astype(np.float64).copy()
  r = body.get("repetition_penalty", 1.0)
  for token in set(prompt) | set(answer):
    out[token] = out[token] / r if out[token] > 0 else out[token] * r
  for token in set(answer):
    c = answer.count(token)
    out[token] -= c * body.get("frequency_penalty", 0.0) + body.get("presence_penalty", 0.0)
  for token, bias in body.get("logit_bias", {}).items():
    out[int(token)] = -np.inf if bias == -100 else out[int(token)] + bias
  return out


async def reference(engine, prompt, body):
  shard, rid = smollm2_shard(), f"ref-{id(body)}"
  logits, _ = await engine.infer_tensor(rid, shard, np.array([prompt]))
  answer = []
  for _ in range(STEPS):
    token = int(np.argmax(processed(logits[0, -1], prompt, answer, body)))
    answer.append(token)
    if token in engine.tokenizer.eos_token_ids:
      break
    logits, _ = await engine.infer_tensor(rid, shard, np.array([[token]]))
  await engine.finish_request(rid)
  return engine.tokenizer.decode(answer, skip_special_tokens=True)


async def post_all(url, path, bodies):
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
    async def one(body):
      async with session.post(f"{url}{path}", json=body) as response:
        return response.status, await response.json()
    return await asyncio.gather(*[one(b) for b in bodies])


def test_penalised_greedy_answers_equal_the_reference_in_one_batch(server, engine):
  prompt = list(engine.tokenizer.encode(PROMPT))
  apple = engine.tokenizer.encode("apple")[0]
  asks = [{}, {"repetition_penalty": 1.5}, {"frequency_penalty": 1.2, "presence_penalty": 0.6}, {"logit_bias": {str(apple): -100, "28": 3.0}},
          {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "logit_bias": {str(apple): -4.0}}]
  replies = asyncio.run(post_all(server.url, "/v1/completions", [{"model": SMOLLM2, "prompt": prompt, "max_tokens": STEPS, "temperature": 0, **a}
                                                                  for a in asks]))
  texts = []
  for ask, (status, reply) in zip(asks, replies):
    assert status == 200, reply
    texts.append(reply["choices"][0]["text"])
    assert texts[-1] == asyncio.run(reference(engine, prompt, ask)), ask
  assert all(t != texts[0] for t in texts[1:]), texts  # each control changed the answer


def test_ollamas_options_are_honoured(server):
  base = {"model": SMOLLM2, "prompt": "Write the word apple ten times.", "stream": False}
  plain, penalised, windowed, capped, seeded, seeded_again, stopped = asyncio.run(post_all(server.url, "/api/generate", [
    {**base, "options": {"temperature": 0, "num_predict": 24}},
    {**base, "options": {"temperature": 0, "num_predict": 24, "repeat_penalty": 1.5, "repeat_last_n": -1}},
    {**base, "options": {"temperature": 0, "num_predict": 24, "repeat_penalty": 1.5, "repeat_last_n": 0}},  # a window of none: no penalty
    {**base, "options": {"temperature": 0, "num_predict": 5}},
    {**base, "options": {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 11, "num_predict": 12}},
    {**base, "options": {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.05, "seed": 11, "num_predict": 12}},
    {**base, "options": {"temperature": 0, "num_predict": 24, "stop": ["apple"]}},
  ]))
  for status, reply in (plain, penalised, windowed, capped, seeded, seeded_again, stopped):
    assert status == 200, reply
  assert penalised[1]["response"] != plain[1]["response"]
  assert windowed[1]["response"] == plain[1]["response"]
  assert capped[1]["eval_count"] == 5 and plain[1]["response"].startswith(capped[1]["response"])
  assert seeded[1]["response"] == seeded_again[1]["response"]
  assert "apple" not in stopped[1]["response"] and plain[1]["response"].startswith(stopped[1]["response"])
  (status, too_small), = asyncio.run(post_all(server.url, "/api/generate", [{**base, "options": {"num_ctx": 8}}]))
  assert status == 400 and "options.num_ctx" in str(too_small)
  (status, fits), = asyncio.run(post_all(server.url, "/api/generate", [{**base, "options": {"num_ctx": 40, "temperature": 0}}]))
  assert status == 200 and fits["prompt_eval_count"] + fits["eval_count"] <= 40


def test_min_tokens_holds_the_end_off(server):
  ask = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Say hi."}], "temperature": 0, "max_tokens": 60}
  (_, short), (_, held) = asyncio.run(post_all(server.url, "/v1/chat/completions", [ask, {**ask, "min_tokens": 30}]))
  assert short["usage"]["completion_tokens"] < 30 and held["usage"]["completion_tokens"] >= 30

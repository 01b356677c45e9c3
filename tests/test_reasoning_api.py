"""A reasoning model's thinking returned apart from its answer, through the real API and the dialects' own clients:
`reasoning_content` in OpenAI chat (streamed as `delta.reasoning_content`), thinking blocks in Anthropic Messages,
`thinking` in Ollama; thinking turned off through the template where it can be; a model that does not reason is
unchanged.

The model is the tiny Qwen3 fixture (tests/fixtures/models/qwen3) with Qwen3's way of holding the tags: `<think>` and
`</think>` tokens of their own. Its weights are random, so its text cannot be made to think: where a test needs
given text, the node's sampling is replaced by a script (Script below) while the real model still runs every
pass; one request per dialect runs the model's own tokens end to end."""
import json
from typing import List

import numpy as np
import pytest
from anthropic import Anthropic

from tests.support.api_server import ApiServer, openai_client, post_json
from tests.support.checkpoints import PLAIN_TEMPLATE, fixture_checkpoint, random_qwen2, served_checkpoints, with_think_tokens, write_hf_dir

pytestmark = pytest.mark.model

# Written for these tests in the shape of Qwen3's templates, using only text the fixture's 512 token ids can hold
# (no role names) unless tools are offered: earlier answers lose their thinking, `enable_thinking` false closes an empty
# thinking block, and calls are asked for in `<tool_call>` tags.
QWEN3_SHAPED = (r"{%- if tools %}{{ '<|im_start|>' + (tools | tojson) + ' <tool_call></tool_call><|im_end|>\n' }}{%- endif %}"
                r"{%- for message in messages %}{{ '<|im_start|>' + (message['content'].split('</think>')[-1] if message['role'] == 'assistant' "
                r"else message['content']) + '<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>' }}"
                r"{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n</think>\n' }}{%- endif %}{%- endif %}")
# The DeepSeek-R1 distills' shape: the prompt opens the thinking block itself, and nothing turns it off.
R1_SHAPED = (r"{%- for message in messages %}{{ '<|im_start|>' + message['content'].split('</think>')[-1] + '<|im_end|>\n' }}{%- endfor %}"
             r"{%- if add_generation_prompt %}{{ '<|im_start|><think>\n' }}{%- endif %}")
QUESTION = [{"role": "user", "content": "in the and of"}]
THOUGHT, ANSWER = "in the and", "in a b c"
QWEN3_TEXT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"  # as Qwen3 writes it


@pytest.fixture(scope="module")
def api(tmp_path_factory):
  root = tmp_path_factory.mktemp("reasoning")
  paths = [with_think_tokens(fixture_checkpoint("qwen3", root / name, template)) for name, template in
           (("qwen3-shaped", QWEN3_SHAPED), ("r1-shaped", R1_SHAPED), ("plain", PLAIN_TEMPLATE))]
  # Grammars need the whole vocabulary (JSON's punctuation merges into tokens past the fixture's 512): a random
  # Qwen2-shaped model with all of SmolLM2's tokens.
  config, weights, tokenizer = random_qwen2(2)
  paths += [with_think_tokens(write_hf_dir(root / f"{name}-full", config, weights, tokenizer, split=False, model_type="qwen2", chat_template=template))
            for name, template in (("qwen3", QWEN3_SHAPED), ("r1", R1_SHAPED))]
  with served_checkpoints() as local:
    models = dict(zip(("qwen3", "r1", "plain", "qwen3-full", "r1-full"), local.serve([str(p) for p in paths], [str(root)])))
    server = ApiServer("numpy", default_model=models["qwen3"]).start()
    server.node.model_pool.max_models = 1  # every model on the node's own engine, the one Script stands in for
    try:
      yield server, models
    finally:
      server.stop()


class Script:
  """Stands in for the node's sampling: each token drawn is the next of a given text's (then the end of turn), while
  the real model runs its passes. Requests run one at a time here, so the tokens are one request's."""

  def __init__(self, server: ApiServer, model: str, text: str):
    self.engine = server.node.inference_engine
    tokenizer = server.call(server.api.core.profiles.get(model))[0]
    # Each newline a token of its own: the fixture's 512 ids have no token for two of them.
    newline = list(tokenizer.encode("\n"))
    self.tokens: List[int] = [t for line in text.split("\n") for t in newline + list(tokenizer.encode(line))][len(newline):] + [tokenizer.eos_token_id]

  async def sample_batch(self, logits, params, generators):
    return np.array([self.tokens.pop(0) for _ in logits])

  def __enter__(self):
    self.engine.sample_batch = self.sample_batch
    return self

  def __exit__(self, *exc):
    del self.engine.sample_batch  # the engine's own again


@pytest.mark.parametrize("model, text", [("qwen3", QWEN3_TEXT), ("r1", f"{THOUGHT}\n</think>\n\n{ANSWER}")])
def test_the_openai_client_reads_reasoning_content_apart_from_the_answer(api, model, text):
  server, models = api
  client = openai_client(server)
  with Script(server, models[model], text):
    reply = client.chat.completions.create(model=models[model], messages=QUESTION, max_tokens=30)
  message = reply.choices[0].message
  assert (message.reasoning_content, message.content, reply.choices[0].finish_reason) == (THOUGHT, ANSWER, "stop")
  with Script(server, models[model], text):
    chunks = list(client.chat.completions.create(model=models[model], messages=QUESTION, max_tokens=30, stream=True))
  deltas = [c.choices[0].delta for c in chunks]
  assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
  assert "".join(d.content or "" for d in deltas) == ANSWER
  thinking_at = [i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None)]
  answer_at = [i for i, d in enumerate(deltas) if d.content]
  assert thinking_at and answer_at and max(thinking_at) < min(answer_at), "the thinking streams first, in chunks of its own"


def test_a_model_that_does_not_reason_is_unchanged(api):
  """Its tokenizer has the tags as tokens; its template does not use them: its text is its answer, tags and all."""
  server, models = api
  text = QWEN3_TEXT
  with Script(server, models["plain"], text):
    status, reply = server.call(post_json(server.url, "/v1/chat/completions", {"model": models["plain"], "messages": QUESTION, "max_tokens": 30}))
  assert status == 200, reply
  assert reply["choices"][0]["message"] == {"role": "assistant", "content": text}


def test_anthropic_messages_return_a_thinking_block_before_the_text(api):
  server, models = api
  client = Anthropic(base_url=server.url, api_key="exo", max_retries=0)
  text = QWEN3_TEXT
  with Script(server, models["qwen3"], text):
    message = client.messages.create(model=models["qwen3"], max_tokens=30, messages=QUESTION)
  assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [("thinking", THOUGHT), ("text", ANSWER)]
  with Script(server, models["qwen3"], text):
    # (the fixture's context of 512 tokens is below what an "enabled" budget asks: at least 1,024)
    with client.messages.stream(model=models["qwen3"], max_tokens=30, messages=QUESTION, thinking={"type": "adaptive"}) as stream:
      kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
      streamed = stream.get_final_message()
  assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content] == [("thinking", THOUGHT), ("text", ANSWER)]
  assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"


async def test_ollama_returns_thinking_and_think_false_turns_it_off_in_the_template(api):
  server, models = api
  text = QWEN3_TEXT
  with Script(server, models["qwen3"], text):
    status, reply = await post_json(server.url, "/api/chat", {"model": models["qwen3"], "messages": QUESTION, "stream": False})
  assert status == 200, reply
  assert (reply["message"]["thinking"], reply["message"]["content"]) == (THOUGHT, ANSWER)
  tokenizer = server.call(server.api.core.profiles.get(models["qwen3"]))[0]
  with Script(server, models["qwen3"], ANSWER):
    status, reply = await post_json(server.url, "/api/chat", {"model": models["qwen3"], "messages": QUESTION, "stream": False, "think": False})
  assert status == 200 and reply["message"] == {"role": "assistant", "content": ANSWER}, reply
  off = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, enable_thinking=False)
  assert off.endswith("<think>\n</think>\n") and reply["prompt_eval_count"] == len(tokenizer.encode(off))
  status, reply = await post_json(server.url, "/api/chat", {"model": models["plain"], "messages": QUESTION, "think": True, "stream": False})
  assert status == 400 and "think" in reply["error"], reply
  status, reply = await post_json(server.url, "/api/show", {"model": models["qwen3"]})
  assert status == 200 and "thinking" in reply["capabilities"], reply


def raw_text(reply: dict) -> str:
  """The reply's tokens' own text, from its logprobs, without its end of turn."""
  return "".join(t["token"] for t in reply["choices"][0]["logprobs"]["content"]).removesuffix("<|im_end|>")


async def test_the_models_own_tokens_end_to_end_thinking_apart_and_switchable(api):
  """No script: the random model's own tokens. The R1-shaped prompt opens the thinking, so what the model writes is
  thinking up to a `</think>` it may or may not write; the answer never holds the thinking."""
  server, models = api
  body = {"model": models["r1"], "messages": QUESTION, "max_tokens": 12, "logprobs": True}
  status, reply = await post_json(server.url, "/v1/chat/completions", body)
  assert status == 200, reply
  raw, message = raw_text(reply), reply["choices"][0]["message"]
  thinking, _, answer = raw.partition("</think>")
  assert message["reasoning_content"] == thinking.strip() and message["content"] == answer.strip(), (raw, message)
  assert message["reasoning_content"] and message["reasoning_content"] not in message["content"]
  # Qwen3's switch: chat_template_kwargs enable_thinking false closes the block in the prompt (4 more tokens).
  on = {"model": models["qwen3"], "messages": QUESTION, "max_tokens": 1}
  status_on, reply_on = await post_json(server.url, "/v1/chat/completions", on)
  status_off, reply_off = await post_json(server.url, "/v1/chat/completions", {**on, "chat_template_kwargs": {"enable_thinking": False}})
  assert status_on == status_off == 200, (reply_on, reply_off)
  assert reply_off["usage"]["prompt_tokens"] == reply_on["usage"]["prompt_tokens"] + 4
  status, reply = await post_json(server.url, "/v1/chat/completions", {**on, "chat_template_kwargs": {"enable_thinking": "no"}})
  assert status == 400 and reply["error"]["param"] == "chat_template_kwargs.enable_thinking", reply


async def test_anthropic_thinking_on_a_model_that_does_not_reason_is_refused(api):
  server, models = api
  body = {"model": models["plain"], "max_tokens": 2048, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1024}}
  status, reply = await post_json(server.url, "/v1/messages", body)
  assert status == 400 and reply["error"]["type"] == "invalid_request_error" and "thinking" in reply["error"]["message"], reply


@pytest.mark.parametrize("model", ["r1-full", "qwen3-full"])
async def test_a_constrained_answer_follows_the_thinking(api, model):
  """The model's own tokens: with a JSON answer asked for, the grammar holds from the end of the thinking on (the
  R1-shaped prompt opened the thinking; the Qwen3-shaped one leaves it to the model)."""
  server, models = api
  schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
  body = {"model": models[model], "messages": QUESTION, "max_tokens": 40, "logprobs": True,
          "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}}
  status, reply = await post_json(server.url, "/v1/chat/completions", body)
  assert status == 200, reply
  message = reply["choices"][0]["message"]
  assert json.loads(message["content"])["city"] in ("Paris", "Rome"), (raw_text(reply), message)
  # The random model thinks until its budget is down to what the answer needs; then the thinking is closed for it.
  assert message["reasoning_content"] and raw_text(reply).endswith("</think>" + message["content"]), (raw_text(reply), message)
  assert reply["choices"][0]["finish_reason"] == "stop"


def test_openai_responses_return_a_reasoning_item_before_the_message(api):
  server, models = api
  client = openai_client(server)
  with Script(server, models["qwen3"], QWEN3_TEXT):
    response = client.responses.create(model=models["qwen3"], input="in the and of", max_output_tokens=30)
  assert [item.type for item in response.output] == ["reasoning", "message"]
  assert response.output[0].content[0].text == THOUGHT and response.output_text == ANSWER
  with Script(server, models["qwen3"], QWEN3_TEXT):
    events = list(client.responses.create(model=models["qwen3"], input="in the and of", max_output_tokens=30, stream=True))
  thinking = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
  final = events[-1].response
  assert thinking == THOUGHT and final.output[0].content[0].text == THOUGHT and final.output_text == ANSWER, events


async def test_responses_reasoning_effort_none_turns_thinking_off_and_a_model_that_does_not_reason_refuses_an_effort(api):
  server, models = api
  body = {"model": models["qwen3"], "input": "in the and of", "max_output_tokens": 1}
  status_on, on = await post_json(server.url, "/v1/responses", body)
  status_off, off = await post_json(server.url, "/v1/responses", {**body, "reasoning": {"effort": "none"}})
  assert status_on == status_off == 200, (on, off)
  assert off["usage"]["input_tokens"] == on["usage"]["input_tokens"] + 4  # the closed thinking block in the prompt
  status, reply = await post_json(server.url, "/v1/responses", {**body, "model": models["plain"], "reasoning": {"effort": "low"}})
  assert status == 400 and reply["error"]["param"] == "reasoning.effort", reply


async def test_a_forced_tool_call_follows_the_thinking(api):
  """The model's own tokens, Qwen3's way: the thinking (if the model opens it) first, then the `<tool_call>`."""
  server, models = api
  weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                                                                       "required": ["city"]}}}
  body = {"model": models["qwen3-full"], "messages": QUESTION, "max_tokens": 60, "logprobs": True, "tools": [weather],
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
  status, reply = await post_json(server.url, "/v1/chat/completions", body)
  assert status == 200, reply
  choice = reply["choices"][0]
  calls = choice["message"]["tool_calls"]
  assert choice["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_weather"], (raw_text(reply), choice)
  assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")
  raw = raw_text(reply)
  thinking, closed, rest = raw.partition("</think>")
  if closed:  # (greedy, these weights open a thinking block, which the budget closes)
    assert choice["message"]["reasoning_content"] == thinking.removeprefix("<think>").strip() and rest.startswith("<tool_call>"), (raw, choice)

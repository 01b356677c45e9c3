"""gpt-oss's harmony channels through the real API and clients: the analysis channel comes back as
`reasoning_content` (streamed apart, before the answer), as a thinking block in Anthropic Messages and `thinking` in
Ollama; the final channel is the answer, and no harmony marker is ever in it; a call to functions.NAME is an OpenAI
tool call, constrained to harmony's form when the request forces it.

The model is the gpt-oss fixture with harmony's markers as special tokens and a harmony chat template written for
these tests (tests/support/checkpoints.py gpt_oss_with_harmony: gpt-oss's own template is not available offline).
Its weights are random, so it cannot be made to write harmony: where a test needs given text, the node's sampling is
replaced by a script (tests/test_reasoning_api.py Script) while the real model still runs every pass; the forced
call is the model's own tokens, held to harmony's form by the grammar."""
import json

import pytest
from anthropic import Anthropic

from tests.support.api_server import ApiServer, openai_client, post_json
from tests.support.checkpoints import gpt_oss_with_harmony, served_checkpoints
from tests.test_reasoning_api import Script

pytestmark = pytest.mark.model

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT, ANSWER = "The user wants the weather. I can answer directly.", "It is sunny in Paris."
REPLY = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>", "<|call|>", "<|constrain|>")


@pytest.fixture(scope="module")
def api(tmp_path_factory):
  root = tmp_path_factory.mktemp("harmony")
  path = gpt_oss_with_harmony(root / "gpt-oss-harmony")
  with served_checkpoints() as local:
    model, = local.serve([str(path)], [str(root)])
    server = ApiServer("numpy", default_model=model).start()
    try:
      yield server, model
    finally:
      server.stop()


def test_the_openai_client_streams_the_analysis_channel_as_reasoning_content(api):
  server, model = api
  client = openai_client(server)
  with Script(server, model, REPLY):
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=60)
  message = reply.choices[0].message
  assert (message.reasoning_content, message.content, reply.choices[0].finish_reason) == (THOUGHT, ANSWER, "stop")
  with Script(server, model, REPLY):
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, max_tokens=60, stream=True))
  deltas = [c.choices[0].delta for c in chunks if c.choices]
  assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
  assert "".join(d.content or "" for d in deltas) == ANSWER
  thinking_at = [i for i, d in enumerate(deltas) if getattr(d, "reasoning_content", None)]
  answer_at = [i for i, d in enumerate(deltas) if d.content]
  assert len(thinking_at) > 1 and thinking_at and answer_at and max(thinking_at) < min(answer_at), "the thinking streams first, as it comes"


def test_anthropic_and_ollama_return_the_analysis_as_thinking(api):
  server, model = api
  client = Anthropic(base_url=server.url, api_key="exo", max_retries=0)
  with Script(server, model, REPLY):
    message = client.messages.create(model=model, max_tokens=60, messages=QUESTION)
  assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [("thinking", THOUGHT), ("text", ANSWER)]
  with Script(server, model, REPLY):
    status, reply = server.call(post_json(server.url, "/api/chat", {"model": model, "messages": QUESTION, "stream": False}))
  assert status == 200 and (reply["message"]["thinking"], reply["message"]["content"]) == (THOUGHT, ANSWER), reply


def test_a_scripted_call_comes_back_as_an_openai_tool_call(api):
  server, model = api
  client = openai_client(server)
  # tool_choice auto holds the reply to harmony too: the script's tokens must be ones the grammar allows (its JSON
  # layout has a space after the colon), or the model would draw in their place.
  text = f'<|channel|>analysis<|message|>Need get_weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{{"city": "Rome"}}<|call|>'
  with Script(server, model, text):
    chunks = list(client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER], max_tokens=60, stream=True))
  deltas = [c.choices[0].delta for c in chunks if c.choices]
  calls = [call for d in deltas for call in d.tool_calls or []]
  assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
  assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Rome"}
  assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Need get_weather."
  assert not "".join(d.content or "" for d in deltas) and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_forced_call_is_the_models_own_tokens_held_to_harmony(api):
  """No script: the random model's tokens, the grammar holding them to an optional analysis message and then the call."""
  server, model = api
  body = {"model": model, "messages": QUESTION, "max_tokens": 80, "tools": [WEATHER], "logprobs": True,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
  status, reply = server.call(post_json(server.url, "/v1/chat/completions", body))
  assert status == 200, reply
  choice = reply["choices"][0]
  raw = "".join(t["token"] for t in choice["logprobs"]["content"])
  calls = choice["message"]["tool_calls"]
  assert choice["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_weather"], (raw, choice)
  assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")
  assert "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" in raw, raw
  for text in (choice["message"].get("content") or "", choice["message"].get("reasoning_content") or ""):
    assert not any(m in text for m in MARKERS), choice


def test_the_models_own_tokens_never_leak_markers_into_the_answer(api):
  server, model = api
  status, reply = server.call(post_json(server.url, "/v1/chat/completions", {"model": model, "messages": QUESTION, "max_tokens": 24}))
  assert status == 200, reply
  message = reply["choices"][0]["message"]
  for text in (message.get("content") or "", message.get("reasoning_content") or ""):
    assert not any(m in text for m in MARKERS), message


def test_a_constrained_answer_follows_the_analysis_and_is_closed_within_budget(api):
  """The model's own tokens: the grammar lets it think in the analysis channel, then holds the final channel to the
  schema; the random model thinks until its budget is down to what the answer needs, and `<|end|>` closes it."""
  server, model = api
  schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
  body = {"model": model, "messages": QUESTION, "max_tokens": 40, "logprobs": True,
          "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}}
  status, reply = server.call(post_json(server.url, "/v1/chat/completions", body))
  assert status == 200, reply
  choice = reply["choices"][0]
  raw = "".join(t["token"] for t in choice["logprobs"]["content"])
  assert json.loads(choice["message"]["content"])["city"] in ("Paris", "Rome") and choice["finish_reason"] == "stop", (raw, choice)
  assert raw.endswith("<|end|><|start|>assistant<|channel|>final<|message|>" + choice["message"]["content"]), raw
  assert choice["message"]["reasoning_content"] and not any(m in choice["message"]["reasoning_content"] for m in MARKERS)


def test_openai_responses_return_the_analysis_as_a_reasoning_item(api):
  server, model = api
  client = openai_client(server)
  with Script(server, model, REPLY):
    response = client.responses.create(model=model, input="What is the weather in Paris?", max_output_tokens=60)
  assert [item.type for item in response.output] == ["reasoning", "message"]
  assert response.output[0].content[0].text == THOUGHT and response.output_text == ANSWER


def test_a_call_and_its_result_go_back_through_the_template(api):
  server, model = api
  call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
  turn = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"}]
  status, reply = server.call(post_json(server.url, "/v1/chat/completions", {"model": model, "messages": turn, "tools": [WEATHER], "max_tokens": 2}))
  assert status == 200, reply
  tokenizer = server.call(server.api.core.profiles.get(model))[0]
  prompt = tokenizer.apply_chat_template([*turn[:1], {**turn[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": {"city": "Rome"}}}]}, turn[2]],
                                         add_generation_prompt=True, tools=[WEATHER])
  assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
          '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>Sunny, 24 C<|end|><|start|>assistant') in prompt
  assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt))


def test_reasoning_effort_reaches_the_template(api):
  """OpenAI chat's reasoning_effort, Responses' reasoning.effort and Ollama's think levels become gpt-oss's template
  variable, as vLLM and Ollama pass it."""
  server, model = api
  from exo.api.chat_request import parse_chat_request
  from exo.api.ollama.request import parse_chat
  from exo.api.openai_responses.request import parse_responses_request
  tokenizer = server.call(server.api.core.profiles.get(model))[0]
  engine = "NumpyDynamicShardInferenceEngine"
  for request in (parse_chat_request({"model": model, "messages": QUESTION, "reasoning_effort": "high"}, model, engine),
                  parse_responses_request({"model": model, "input": "Hi", "reasoning": {"effort": "high"}}, model, engine).generation,
                  parse_chat({"model": model, "messages": QUESTION, "think": "high"}, model, engine)):
    (prompt, _), = server.api.core._prompts(tokenizer, request)[0]
    assert "Reasoning: high" in prompt, prompt
  status, reply = server.call(post_json(server.url, "/v1/chat/completions", {"model": model, "messages": QUESTION, "reasoning_effort": "lots"}))
  assert status == 400 and reply["error"]["param"] == "reasoning_effort", reply

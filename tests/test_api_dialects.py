"""Every dialect end to end with its official client, unmodified, against the real SmolLM2 on the numpy engine: a plain
answer, a stream, a tool round trip (a call, its result, a final answer in text; SmolLM2 writes calls in the generic
JSON format) and the dialect's error shape for a bad request, for Anthropic's `anthropic`, OpenAI's Responses
through `openai`, and `ollama`. The same greedy conversation gives the same text through all of them and through
OpenAI's chat and completions."""
import json

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.support.api_server import shared_server

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
SYSTEM = "You are a concise geography teacher."
QUESTION = "What is the capital of France?"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_RESULT = '{"temperature_c": 21, "sky": "sunny"}'
ASK_WEATHER = "Use the get_weather tool to find the weather in Paris."


@pytest.fixture(scope="module")
def server():
  return shared_server("numpy")


@pytest.fixture(scope="module")
def claude(server):
  return anthropic.Anthropic(base_url=server.url, api_key="exo", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def llama(server):
  return ollama.Client(host=server.url, timeout=300)


# --- the same greedy conversation through every dialect ---

def test_the_same_greedy_conversation_gives_the_same_text_through_every_dialect(server, client, claude, llama):
  budget = 24  # tokens: long enough to say something, short enough to run seven times
  conversation = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
  texts = {"chat": client.chat.completions.create(model=MODEL, messages=conversation, max_tokens=budget, temperature=0).choices[0].message.content}
  prompt = httpx.post(f"{server.url}/v1/chat/token/encode", json={"model": MODEL, "messages": conversation}).json()["encoded_prompt"]
  texts["completions"] = client.completions.create(model=MODEL, prompt=prompt, max_tokens=budget, temperature=0).choices[0].text
  texts["anthropic"] = claude.messages.create(model=MODEL, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}], max_tokens=budget,
                                              extra_body={"temperature": 0}).content[0].text
  texts["responses"] = client.responses.create(model=MODEL, instructions=SYSTEM, input=QUESTION, max_output_tokens=budget, temperature=0).output_text
  options = {"temperature": 0, "num_predict": budget}
  texts["ollama chat"] = llama.chat(model=MODEL, messages=conversation, options=options, stream=False).message.content
  texts["ollama generate"] = llama.generate(model=MODEL, system=SYSTEM, prompt=QUESTION, options=options, stream=False).response
  texts["ollama raw"] = llama.generate(model=MODEL, prompt=prompt, raw=True, options=options, stream=False).response
  assert "Paris" in texts["chat"]
  assert all(text == texts["chat"] for text in texts.values()), texts


# --- Anthropic Messages ---

def test_anthropic_answer_and_stream(claude):
  ask = {"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": QUESTION}]}
  message = claude.messages.create(**ask)
  assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
  assert message.stop_reason in ("end_turn", "max_tokens") and message.content[0].type == "text" and message.content[0].text
  assert message.usage.input_tokens == claude.messages.count_tokens(model=MODEL, messages=ask["messages"]).input_tokens
  with claude.messages.stream(**ask) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
  assert text == message.content[0].text and final.stop_reason == message.stop_reason
  assert final.usage.output_tokens == message.usage.output_tokens
  stopped = claude.messages.create(**ask, stop_sequences=[text.split()[1]])
  assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == text.split()[1]
  assert stopped.content[0].text == text[:text.index(text.split()[1])]


def test_anthropic_tool_round_trip_streamed(claude):
  tools = [{"name": "get_weather", "description": "Get the current weather in a city", "input_schema": WEATHER_SCHEMA}]
  ask = [{"role": "user", "content": "What is the weather in Paris?"}]
  kinds = []
  with claude.messages.stream(model=MODEL, max_tokens=60, messages=ask, tools=tools,
                              tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
    for event in stream:
      kinds.append((event.type, getattr(getattr(event, "delta", None), "type", None)))
    called = stream.get_final_message()
  assert called.stop_reason == "tool_use" and [b.type for b in called.content] == ["tool_use"]
  call = called.content[0]
  assert call.name == "get_weather" and call.id.startswith("toolu_") and isinstance(call.input["city"], str)
  assert kinds.count(("content_block_delta", "input_json_delta")) > 1  # the input streamed in fragments
  follow = ask + [{"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": WEATHER_RESULT}]}]
  final = claude.messages.create(model=MODEL, max_tokens=60, messages=follow, tools=tools, tool_choice={"type": "none"})
  assert final.stop_reason == "end_turn" and final.content[0].type == "text" and "sunny" in final.content[0].text


def test_anthropic_bad_request_is_its_error_shape(claude):
  with pytest.raises(anthropic.BadRequestError) as error:
    claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "robot", "content": "hi"}])
  assert error.value.status_code == 400
  assert error.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": error.value.body["error"]["message"]}}
  assert "messages[0]" in error.value.body["error"]["message"]


# --- OpenAI Responses ---

def test_responses_answer_and_stream(client):
  response = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40)
  assert response.status in ("completed", "incomplete") and response.output[0].type == "message" and response.output_text
  assert response.usage.input_tokens > 0 and response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
  events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=40, stream=True))
  assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
  assert events[-1].type == ("response.completed" if response.status == "completed" else "response.incomplete")
  assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text == events[-1].response.output_text
  assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_tool_round_trip(client):
  tools = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city", "parameters": WEATHER_SCHEMA,
            "strict": True}]
  ask = [{"role": "user", "content": "What is the weather in Paris?"}]
  with client.responses.stream(model=MODEL, input=ask, tools=tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=60) as stream:
    kinds = [event.type for event in stream]
    called = stream.get_final_response()
  calls = [item for item in called.output if item.type == "function_call"]
  assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments)["city"]
  assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
  follow = ask + [calls[0].model_dump(include={"type", "call_id", "name", "arguments"}),
                  {"type": "function_call_output", "call_id": calls[0].call_id, "output": WEATHER_RESULT}]
  final = client.responses.create(model=MODEL, input=follow, tools=tools, tool_choice="none", max_output_tokens=60)
  assert final.status == "completed" and "sunny" in final.output_text and not [i for i in final.output if i.type == "function_call"]


def test_responses_bad_request_is_openais_error_shape(client):
  with pytest.raises(openai.BadRequestError) as error:
    client.responses.create(model=MODEL, input=QUESTION, tools=[{"type": "web_search"}])
  assert error.value.status_code == 400 and error.value.body["param"] == "tools[0].type" and error.value.body["type"] == "invalid_request_error"


# --- Ollama ---

def test_ollama_answer_and_stream(llama):
  ask = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], "options": {"num_predict": 40}}
  reply = llama.chat(**ask, stream=False)
  assert reply.done and reply.done_reason in ("stop", "length") and reply.message.role == "assistant" and reply.message.content
  assert reply.model == f"{MODEL}:latest" and reply.prompt_eval_count > 0 and reply.eval_count > 0 and reply.total_duration > 0
  parts = list(llama.chat(**ask, stream=True))
  assert "".join(p.message.content for p in parts) == reply.message.content
  assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == reply.eval_count
  place = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}}, "required": ["city", "country"]}
  structured = llama.chat(model=MODEL, messages=[{"role": "user", "content": "Name a city and its country."}], stream=False,
                          options={"num_predict": 60}, format=place)
  assert set(json.loads(structured.message.content)) == {"city", "country"}
  assert f"{MODEL}:latest" in [m.model for m in llama.list().models] and llama.show(MODEL).modelinfo["llama.context_length"] > 0


def test_ollama_tool_round_trip(llama):
  tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city", "parameters": WEATHER_SCHEMA}}]
  ask = [{"role": "user", "content": ASK_WEATHER}]
  called = llama.chat(model=MODEL, messages=ask, tools=tools, options={"num_predict": 60}, stream=False)
  assert called.message.tool_calls and called.message.tool_calls[0].function.name == "get_weather"
  assert called.message.tool_calls[0].function.arguments["city"]
  streamed = [p for p in llama.chat(model=MODEL, messages=ask, tools=tools, options={"num_predict": 60}, stream=True) if p.message.tool_calls]
  assert [c.function for p in streamed for c in p.message.tool_calls] == [c.function for c in called.message.tool_calls]
  follow = ask + [called.message.model_dump(exclude_none=True)] + [{"role": "tool", "tool_name": c.function.name, "content": WEATHER_RESULT}
                                                                    for c in called.message.tool_calls]
  final = llama.chat(model=MODEL, messages=follow, tools=tools, options={"num_predict": 60}, stream=False)  # (Ollama has no tool_choice)
  assert final.done_reason == "stop" and not final.message.tool_calls and "sunny" in final.message.content


def test_ollama_bad_request_is_its_error_shape(llama):
  with pytest.raises(ollama.ResponseError) as error:
    llama.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"top_k": -1}, stream=False)
  assert error.value.status_code == 400 and "options.top_k" in error.value.error
  with pytest.raises(ollama.ResponseError) as error:
    llama.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}], stream=False)
  assert error.value.status_code == 404 and error.value.error == "model 'no-such-model' not found"

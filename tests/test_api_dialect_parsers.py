"""Each dialect's parser and renderer as pure code: Anthropic's, OpenAI Responses' and Ollama's bodies become the core's
conversation (tool calls and their results included) and sampling parameters; bad fields are 400s naming them; and
a scripted run of core events renders as each dialect's stream (block indices, sequence numbers, closing events)."""
import json

import pytest

from exo.api.anthropic.render import MessageStream
from exo.api.anthropic.request import parse_count_request, parse_messages_request
from exo.api.errors import ApiError, BadRequest
from exo.api.events import Delta, Finish, Started, ToolCallFragment, Usage
from exo.api.ollama.render import OllamaReply
from exo.api.ollama.request import parse_chat, parse_generate
from exo.api.openai_responses.render import ResponseShape, ResponseStream
from exo.api.openai_responses.request import parse_responses_request

pytestmark = pytest.mark.unit

ENGINE = "DummyInferenceEngine"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def anthropic(body):
  return parse_messages_request({"model": "dummy", "max_tokens": 10, **body}, "dummy", ENGINE)


def responses(body):
  return parse_responses_request({"model": "dummy", **body}, "dummy", ENGINE)


def ollama_chat(body):
  return parse_chat({"model": "dummy", **body}, "dummy", ENGINE)


# --- Anthropic ---

def test_anthropic_conversation_with_tool_use_and_results():
  request = anthropic({
    "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "...", "signature": "s"}, {"type": "text", "text": "Let me look."},
                                                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                                              {"type": "text", "text": "And tomorrow?"}]}],
    "tools": [{"name": "get_weather", "input_schema": SCHEMA}], "tool_choice": {"type": "tool", "name": "get_weather"},
    "stop_sequences": ["\n\n"], "top_k": 5, "model": "claude-sonnet-4-5"})
  assert request.model == "dummy" and request.stop == ["\n\n"] and request.params.top_k == 5 and request.params.max_tokens == 10
  assert request.messages == [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [{"id": "toolu_1", "type": "function",
                                                                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}, {"role": "user", "content": "And tomorrow?"}]
  assert (request.tool_use.choice, request.tool_use.name, request.tool_use.tools[0].parameters) == ("function", "get_weather", SCHEMA)


@pytest.mark.parametrize("choice,expected", [({"type": "auto"}, ("auto", True)), ({"type": "any", "disable_parallel_tool_use": True}, ("required", False)),
                                             ({"type": "none"}, None)])
def test_anthropic_tool_choices(choice, expected):
  use = anthropic({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": choice}).tool_use
  assert (None if use is None else (use.choice, use.parallel)) == expected


@pytest.mark.parametrize("body,field", [
  ({"max_tokens": None}, "max_tokens"),
  ({"messages": []}, "messages"),
  ({"messages": [{"role": "system", "content": "x"}]}, "messages[0]"),
  ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "1", "name": "f", "input": {}}]}]}, "messages[0].content[0].type"),
  ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
  ({"temperature": 1.5}, "temperature"),
  ({"stop_sequences": ["x"] * 17}, "stop_sequences"),
  ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
  ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
  ({"tools": [{"name": "f", "input_schema": {"type": "array"}}]}, "tools[0].input_schema"),
  ({"tool_choice": {"type": "tool", "name": "g"}, "tools": [{"name": "f", "input_schema": SCHEMA}]}, "tool_choice"),
  ({"tool_choice": {"type": "any"}}, "tool_choice"),
  ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),  # not below max_tokens
  ({"thinking": {"type": "on"}}, "thinking"),
  ({"output_config": {"effort": "high"}}, "output_config.effort"),
  ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "strnig"}}}}, "output_config.format.schema"),
  ({"container": "c"}, "container"),
])
def test_anthropic_bad_fields_are_400s_naming_them(body, field):
  with pytest.raises(BadRequest) as error:
    anthropic({"messages": [{"role": "user", "content": "x"}], **body})
  assert error.value.param == field, error.value.message


def test_anthropic_count_tokens_takes_the_prompt_fields_only():
  assert parse_count_request({"model": "dummy", "messages": [{"role": "user", "content": "x"}]}, "dummy", ENGINE).messages[0]["content"] == "x"
  with pytest.raises(BadRequest, match="max_tokens"):
    parse_count_request({"model": "dummy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}, "dummy", ENGINE)


def test_anthropic_stream_events_for_text_then_a_tool_call():
  render = MessageStream("dummy")
  events = [Started("r-1", 7, 1), Delta(0, "Hi", None), Delta(0, " there", None),
            Delta(0, "", None, [ToolCallFragment(0, "call_ab", "f", '{"a": ')]),
            Delta(0, "", None, [ToolCallFragment(0, None, None, "1}")], Finish("tool_calls")),
            Usage(7, 5)]
  out = [e for event in events for e in render(event)]
  assert [(e["type"], e.get("index")) for e in out] == [
    ("message_start", None), ("ping", None), ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
    ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1), ("message_delta", None),
    ("message_stop", None)]
  assert out[0]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0} and out[0]["message"]["id"] == "msg_r1"
  assert out[6]["content_block"] == {"type": "tool_use", "id": "toolu_ab", "name": "f", "input": {}}
  assert "".join(e["delta"]["partial_json"] for e in out if e.get("index") == 1 and e["type"] == "content_block_delta") == '{"a": 1}'
  assert out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None} and out[-2]["usage"] == {"output_tokens": 5}


# --- OpenAI Responses ---

def test_responses_input_items_become_a_conversation():
  parsed = responses({"instructions": "Be brief.", "input": [
    {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}, {"type": "input_image", "image_url": "data:..."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
    {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
    {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": '{"a": 1}'},
    {"type": "reasoning", "summary": []},
    {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}], "max_output_tokens": 20,
    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}],
    "text": {"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}}})
  request = parsed.generation
  assert [m["role"] for m in request.messages] == ["system", "user", "assistant", "tool"]
  assert request.messages[1]["content"].startswith("Weather?\n[An image")
  assert [c["id"] for c in request.messages[2]["tool_calls"]] == ["call_1", "call_2"] and request.messages[2]["content"] == "Looking."
  assert request.messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
  assert request.params.max_tokens == 20 and request.response_format.schema == SCHEMA and request.tool_use.tools[0].strict  # strict unless told
  assert parsed.echo["max_output_tokens"] == 20 and parsed.echo["text"]["format"]["name"] == "w"
  assert request.fields.max_tokens == "max_output_tokens"


@pytest.mark.parametrize("body,field", [
  ({"input": []}, "input"),
  ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
  ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
  ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
  ({"previous_response_id": "resp_1"}, "previous_response_id"),
  ({"conversation": "conv_1"}, "conversation"),
  ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),  # (an effort on a model that does not reason: the serving core's 400)
  ({"reasoning": {"budget": 1}}, "reasoning"),
  ({"background": True}, "background"),
  ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
  ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "not": {}}}]}, "tools[0].parameters"),
  ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
  ({"text": {"format": {"type": "json_schema", "schema": {"type": "strnig"}}}}, "text.format.schema"),
  ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
  ({"max_output_tokens": 0}, "max_output_tokens"),
  ({"include": ["file_search_call.results"]}, "include"),
])
def test_responses_bad_fields_are_400s_naming_them(body, field):
  with pytest.raises(BadRequest) as error:
    responses({"input": "x", **body})
  assert error.value.param == field, error.value.message


def test_responses_stream_events_close_each_item_and_number_every_event():
  stream = ResponseStream(ResponseShape("dummy", {"tools": []}))
  events = [Started("r-1", 3, 1), Delta(0, "Hi", None), Delta(0, "", None, [ToolCallFragment(0, "call_x", "f", '{"a"')]),
            Delta(0, "", None, [ToolCallFragment(0, None, None, ": 1}")], Finish("length")), Usage(3, 4)]
  out = [e for event in events for e in stream(event)]
  assert [e["type"] for e in out] == [
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.output_item.added",
    "response.function_call_arguments.delta", "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "response.output_item.done", "response.incomplete"]
  assert [e["sequence_number"] for e in out] == list(range(len(out)))
  final = out[-1]["response"]
  assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
  assert [i["type"] for i in final["output"]] == ["message", "function_call"] and final["output"][1]["arguments"] == '{"a": 1}'
  assert final["output"][0]["content"][0]["text"] == "Hi" and final["usage"]["total_tokens"] == 7
  failed = stream.error_events(ApiError(504, "too slow", code="response_timeout"))
  assert [e["type"] for e in failed] == ["error", "response.failed"] and failed[1]["response"]["error"]["code"] == "response_timeout"


# --- Ollama ---

def test_ollama_tool_results_answer_their_calls_by_name():
  request = ollama_chat({"messages": [
    {"role": "user", "content": "x", "images": ["aGk="]},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "a", "arguments": {"x": 1}}}, {"function": {"name": "b", "arguments": {}}}]},
    {"role": "tool", "tool_name": "b", "content": "B"}, {"role": "tool", "content": "A"}],
    "options": {"temperature": 0.5, "num_predict": -1, "stop": ["\n"], "num_ctx": 4096, "seed": -1}, "format": "json"})
  calls = request.messages[1]["tool_calls"]
  assert [c["function"]["arguments"] for c in calls] == ['{"x": 1}', "{}"]
  assert request.messages[2]["tool_call_id"] == calls[1]["id"] and request.messages[3]["tool_call_id"] == calls[0]["id"]
  assert request.messages[0]["content"].startswith("x\n[An image")
  assert (request.params.temperature, request.params.max_tokens, request.stop, request.stream) == (0.5, None, ["\n"], True)
  assert request.response_format.kind == "json_object"


def test_ollama_generate_templates_the_prompt_unless_raw_and_loads_on_an_empty_one():
  assert parse_generate({"model": "dummy:latest", "prompt": "hi", "system": "s"}, "dummy", ENGINE).messages == [
    {"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
  raw = parse_generate({"model": "dummy", "prompt": "hi", "raw": True, "stream": False, "options": {"num_predict": 3}}, "dummy", ENGINE)
  assert raw.prompts == ["hi"] and raw.messages is None and raw.params.max_tokens == 3 and not raw.stream
  assert parse_generate({"model": "dummy", "system": "s"}, "dummy", ENGINE).prompts == [""]


@pytest.mark.parametrize("body,field", [
  ({"options": {"top_k": -1}}, "options.top_k"),
  ({"options": {"num_predict": 0}}, "options.num_predict"),
  ({"options": {"repeat_penalty": 0}}, "options.repeat_penalty"),
  ({"options": {"repeat_last_n": -2}}, "options.repeat_last_n"),
  ({"options": {"presence_penalty": 3}}, "options.presence_penalty"),
  ({"options": {"num_ctx": 0}}, "options.num_ctx"),
  ({"options": {"mirostat": 2}}, "options.mirostat"),
  ({"options": {"warp": 1}}, "options.warp"),
  ({"format": "xml"}, "format"),
  ({"format": {"type": "strnig"}}, "format.schema"),
  ({"think": "max"}, "think"),  # (gpt-oss's levels low, medium, high are taken; true is for the serving core to judge: whether the model reasons)
  ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
  ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
  ({"model": ""}, "model"),
])
def test_ollama_bad_fields_are_400s_naming_them(body, field):
  with pytest.raises(BadRequest) as error:
    ollama_chat({"messages": [{"role": "user", "content": "x"}], **body})
  assert error.value.param == field, error.value.message


def test_ollama_unknown_model_is_404():
  with pytest.raises(ApiError) as error:
    ollama_chat({"model": "llama3:8b", "messages": [{"role": "user", "content": "x"}]})
  assert error.value.status == 404 and error.value.message == "model 'llama3:8b' not found"


def test_ollama_stream_lines_and_whole_reply():
  events = [Started("r", 2, 1), Delta(0, "Hi", None), Delta(0, "", None, [ToolCallFragment(0, "call_1", "f", '{"a": 1}')], Finish("tool_calls")),
            Usage(2, 3)]
  reply = OllamaReply("dummy", True, 0)
  lines = [line for event in events for line in reply(event)]
  assert [line["done"] for line in lines] == [False, False, True]
  assert lines[0]["message"] == {"role": "assistant", "content": "Hi"}
  assert lines[1]["message"]["tool_calls"] == [{"function": {"name": "f", "arguments": {"a": 1}}}]
  assert (lines[2]["done_reason"], lines[2]["prompt_eval_count"], lines[2]["eval_count"], lines[2]["model"]) == ("stop", 2, 3, "dummy:latest")
  whole = reply.whole(Usage(2, 3))
  assert whole["message"]["content"] == "Hi" and whole["message"]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and whole["done"]
  generated = OllamaReply("dummy", False, 0)
  assert [line.get("response") for event in events[:2] for line in generated(event)] == ["Hi"]
  assert json.dumps(lines[2])  # plain JSON all through


# --- any malformed field is a 4xx, never a server error ---

ODD_VALUES = [None, True, -1, 2.5, "x", "", [], [1], [{}], ["x"], [[]], {}, {"type": 1}, {"a": {"b": []}}]
PARSERS = {
  "anthropic": (parse_messages_request, {"model": "dummy", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]},
                ["model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata",
                 "output_config", "cache_control", "thinking", "service_tier", "user_profile_id"]),
  "responses": (parse_responses_request, {"model": "dummy", "input": "x"},
                ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls", "text",
                 "stream", "store", "metadata", "include", "previous_response_id", "reasoning", "truncation", "user"]),
  "ollama chat": (parse_chat, {"model": "dummy", "messages": [{"role": "user", "content": "x"}]},
                  ["model", "messages", "tools", "format", "options", "stream", "think", "logprobs", "top_logprobs"]),
  "ollama generate": (parse_generate, {"model": "dummy", "prompt": "x"},
                      ["model", "prompt", "system", "raw", "format", "options", "stream", "images", "context", "suffix", "template"]),
}


@pytest.mark.parametrize("dialect", list(PARSERS))
def test_odd_values_in_any_field_are_client_errors_never_crashes(dialect):
  parse, good, fields = PARSERS[dialect]
  for field in fields:
    for value in ODD_VALUES:
      for body in ({**good, field: value}, {**good, field: [value]}, {**good, field: {"type": "function", "name": "f", "x": value}}):
        try:
          parse(body, "dummy", ENGINE)
        except ApiError as e:
          assert 400 <= e.status < 500, (field, value, e.message)


def test_ollamas_sampling_options_map_onto_the_cores():
  params = ollama_chat({"messages": [{"role": "user", "content": "hi"}], "options": {
    "repeat_penalty": 1.3, "repeat_last_n": 32, "presence_penalty": 0.5, "frequency_penalty": 0.2, "top_k": 5, "top_p": 0.9, "min_p": 0.1,
    "seed": 7, "num_predict": 12, "num_ctx": 512, "stop": ["x"]}})
  p = params.params
  assert (p.repetition_penalty, p.penalty_window, p.presence_penalty, p.frequency_penalty) == (1.3, 32, 0.5, 0.2)
  assert (p.top_k, p.top_p, p.min_p, p.seed, p.max_tokens, params.context, params.stop) == (5, 0.9, 0.1, 7, 12, 512, ["x"])
  default = ollama_chat({"messages": [{"role": "user", "content": "hi"}], "options": {"repeat_penalty": 1.1}}).params
  assert default.penalty_window == 64  # Ollama's default window
  assert ollama_chat({"messages": [{"role": "user", "content": "hi"}], "options": {"repeat_last_n": -1}}).params.penalty_window == 2**31 - 1

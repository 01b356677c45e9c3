"""Structured output's pure parts: the distribution a constrained row is drawn from, bitmask reading, object schemas
closed, tool formats read as they stream (OpenAI's deltas), bad request fields each a 400 naming the field, and the
grammar checked in a peer's parameters."""
import json

import numpy as np
import pytest

from exo.api.chat_request import parse_chat_request
from exo.api.errors import BadRequest
from exo.api.tool_formats import (GenericFormat, HermesFormat, Llama3Format, MistralArgsFormat, MistralFormat, ToolCallStream, format_for,
                                  json_string_so_far, mistral_id)
from exo.inference import constrained, grammar
from exo.inference.sampling import SamplingParams, allowed, make_generator, masked
from exo.orchestration import statuses

pytestmark = pytest.mark.unit


def bitmask(allowed_ids, vocab):
  words = np.zeros((1, (vocab + 31) // 32), dtype=np.uint32)
  for t in allowed_ids:
    words[0, t >> 5] |= np.uint32(1 << (t & 31))
  return words.view(np.int32)


class Sampler:
  """The engines' default vectorised sampling (InferenceEngine.sample_batch), without a model."""
  async def sample_batch(self, logits, params, generators):
    from exo.inference.sampling import last_rows, sample_rows
    return sample_rows(last_rows(logits), params, generators)


def test_bitmasks_are_read_bit_by_bit_and_mask_logits():
  mask = bitmask([1, 33, 40], 70)
  assert list(allowed(np.repeat(mask, 4, axis=0), np.array([1, 2, 33, 69]))) == [True, False, True, False]
  rows = masked(np.zeros((1, 70)), mask)
  assert list(np.nonzero(np.isfinite(rows[0]))[0]) == [1, 33, 40]
  assert not np.isfinite(masked(np.zeros((1, 90)), mask)[0, 64:]).any()  # tokens past the mask are never allowed


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9), SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0, top_p=0.8)])
async def test_a_constrained_row_is_drawn_from_its_masked_distribution(params):
  vocab, keep = 8, [1, 3, 4, 6]
  logits = np.log(np.array([0.3, 0.05, 0.2, 0.1, 0.05, 0.15, 0.1, 0.05], dtype=np.float32))[None, None, :]
  mask = bitmask(keep, vocab)
  generator, draws = make_generator(7), 6000
  counts = np.zeros(vocab)
  for _ in range(draws):
    tokens, _ = await constrained.sample(Sampler(), [logits], [params], [generator], [object()], [mask[0]])
    counts[tokens[0]] += 1
  # The documented distribution: disallowed tokens at -inf, then temperature, then top-k / top-p on what is left.
  scaled = np.where(np.isin(np.arange(vocab), keep), logits[0, 0], -np.inf) / params.temperature
  probs = np.exp(scaled - scaled.max())
  order = np.argsort(-probs, kind="stable")
  cut = np.zeros(vocab, dtype=bool)
  total, mass = probs.sum(), 0.0
  for rank, t in enumerate(order):
    if probs[t] == 0 or (params.top_k and rank >= params.top_k) or mass >= params.top_p * total:
      break
    cut[t], mass = True, mass + probs[t]
  expected = np.where(cut, probs, 0) / np.where(cut, probs, 0).sum()
  assert counts[~cut].sum() == 0
  assert np.abs(counts / draws - expected).max() < 0.025, (counts / draws, expected)


async def test_greedy_constrained_is_the_best_allowed_token_and_free_rows_are_untouched():
  logits = np.array([[[0.0, 5.0, 1.0, 3.0]], [[0.0, 5.0, 1.0, 3.0]]], dtype=np.float32)
  tokens, _ = await constrained.sample(Sampler(), list(logits), [SamplingParams()] * 2, [make_generator(0)] * 2, [object(), None],
                                       [bitmask([2, 3], 4)[0], None])
  assert list(tokens) == [3, 1]


def test_schemas_are_tightened_only_where_they_say_nothing():
  schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer", "minimum": 0}}}, "c": {"type": "object"}},
            "$defs": {"x": {"properties": {"y": {"type": ["integer", "null"]}}}}, "anyOf": [{"properties": {"z": {}}, "additionalProperties": True}]}
  closed = grammar.tightened(schema)
  assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
  assert "additionalProperties" not in closed["properties"]["c"]  # {"type": "object"}: any object, as json_object asks
  assert closed["$defs"]["x"]["additionalProperties"] is False and closed["anyOf"][0]["additionalProperties"] is True
  assert "additionalProperties" not in schema  # the request's own schema is left as it was
  b, y = closed["properties"]["a"]["properties"]["b"], closed["$defs"]["x"]["properties"]["y"]
  assert b == {"type": "integer", "minimum": 0, "maximum": grammar.SAFE_INTEGER}  # no endless digits
  assert y["minimum"] == -grammar.SAFE_INTEGER and y["maximum"] == grammar.SAFE_INTEGER


def stream_all(fmt, text, step=3):
  """Feed `text` in pieces; the deltas joined must give what the whole text reads as."""
  stream, content, calls = ToolCallStream(fmt), "", {}
  for i in range(0, len(text), step):
    piece = text[i:i + step]
    new, deltas = stream.feed(piece, i + step >= len(text))
    content += new
    for d in deltas:
      call = calls.setdefault(d["index"], {"id": d.get("id"), "name": d.get("function", {}).get("name"), "arguments": ""})
      assert ("id" in d) == (call["arguments"] == "" and "name" in d["function"])  # id, type and name once, first
      call["arguments"] += d["function"]["arguments"]
  assert [c["arguments"] for c in calls.values()] == [c["function"]["arguments"] for c in stream.tool_calls()]
  return content, [(c["name"], json.loads(c["arguments"])) for c in calls.values()], stream


def test_each_format_is_read_as_it_streams():
  hermes = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": [1, 2]}}\n</tool_call>'
  content, calls, stream = stream_all(HermesFormat(None), hermes)
  assert content == "Let me look.\n" and calls == [("get_weather", {"city": "Paris"}), ("add", {"a": [1, 2]})]
  assert stream.final_content() == "Let me look."
  content, calls, _ = stream_all(HermesFormat(None), "A plain <tool answer.")
  assert content == "A plain <tool answer." and calls == []
  content, calls, _ = stream_all(Llama3Format(None), '{"name": "add", "parameters": {"a": 1, "b": "}"}}')
  assert content == "" and calls == [("add", {"a": 1, "b": "}"})]
  content, calls, stream = stream_all(GenericFormat(None), '{"tool_calls": [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": "a\\"b"}}]}', 2)
  assert calls == [("f", {}), ("g", {"x": 'a"b'})] and stream.final_content() is None
  content, calls, _ = stream_all(GenericFormat(None), '{"response": "Caf\\u00e9 \\"ok\\"\\n"}', 1)
  assert content == 'Café "ok"\n' and calls == []
  assert json_string_so_far('"ab\\u00', 0) == "ab"  # an escape cut short waits


def test_mistrals_formats_are_read_as_they_stream():
  listed = 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": [1, "]"]}}]'
  for step in (1, 3, 100):
    content, calls, stream = stream_all(MistralFormat(None), listed, step)
    assert content == "Sure. " and calls == [("get_weather", {"city": "Paris"}), ("add", {"a": [1, "]"]})]
    assert stream.final_content() == "Sure." and all(len(i) == 9 and i.isalnum() for i in stream.ids)
  content, calls, _ = stream_all(MistralArgsFormat(None), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1}', 2)
  assert content == "" and calls == [("get_weather", {"city": "Paris"}), ("add", {"a": 1})]
  content, calls, _ = stream_all(MistralFormat(None), "A plain [TOOL answer.")
  assert content == "A plain [TOOL answer." and calls == []


def test_mistral_call_ids_are_nine_letters_and_digits_and_stay_matched():
  assert mistral_id("abcDEF123") == "abcDEF123"
  made = mistral_id("call_0123456789abcdef01234567")
  assert len(made) == 9 and made.isalnum() and made == mistral_id("call_0123456789abcdef01234567") != mistral_id("call_other")
  conversation = [{"role": "user", "content": "x"},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
  messages, _ = MistralFormat(None).conversation(conversation, None)
  assert messages[1]["tool_calls"][0]["id"] == messages[2]["tool_call_id"] == mistral_id("call_1")
  assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1} and conversation[2]["tool_call_id"] == "call_1"


class Templated:
  def __init__(self, chat_template):
    self.chat_template = chat_template


def test_the_format_is_read_from_the_template():
  assert type(format_for(Templated("{{ '[TOOL_CALLS] [' }}"))) is MistralFormat
  assert type(format_for(Templated("{{ '[TOOL_CALLS]' + name + '[ARGS]' }}"))) is MistralArgsFormat
  assert type(format_for(Templated("<|start_header_id|>ipython"))) is Llama3Format


CHAT = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
BAD_INPUTS = [
  ({"response_format": "json"}, "response_format"),
  ({"response_format": {"type": "xml"}}, "response_format.type"),
  ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}}, "response_format.json_schema.schema"),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": "3"}}}}, "response_format.json_schema.schema"),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}, "strict": True}}}, "response_format.json_schema.schema"),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}}, "response_format.json_schema.schema"),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}}}}, "response_format.json_schema.schema"),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}}}, "response_format.json_schema.schema"),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format.json_schema.schema"),
  ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}}, "response_format.json_schema.strict"),
  ({"tools": {"type": "function"}}, "tools"),
  ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
  ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
  ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
  ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools[0].function.parameters"),
  ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}}]}, "tools[0].function.parameters"),
  ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "send_email"}}}, "tool_choice"),
  ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
  ({"tool_choice": "required"}, "tool_choice"),
  ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
  ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": {}}}]}]},
   "messages[0].tool_calls[0]"),
  ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
  ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]}, "messages[0].tool_call_id"),
]


@pytest.mark.parametrize("fields,param", BAD_INPUTS)
def test_each_bad_structured_field_is_a_400_naming_it(fields, param):
  with pytest.raises(BadRequest) as error:
    parse_chat_request({**CHAT, **fields}, "smollm2-135m", "NumpyDynamicShardInferenceEngine")
  assert error.value.status == 400 and error.value.param == param, error.value.message


def test_a_peers_grammar_is_checked_like_its_other_parameters():
  good = statuses.RequestParams.build(request_id="r", params=SamplingParams(grammar="start: \"x\""), origin="n")
  assert statuses.sampling_params(json.loads(good)["params"]).grammar == 'start: "x"'
  for bad in (5, "", "x" * (grammar.MAX_GRAMMAR_CHARS + 1)):
    with pytest.raises(statuses.InvalidStatus, match="grammar"):
      statuses.sampling_params({**SamplingParams().to_dict(), "grammar": bad})


async def test_a_constrained_rows_logprobs_are_those_of_its_masked_distribution_and_finite():
  from exo.inference.sampling import token_logprobs
  logits = np.log(np.array([[[0.5, 0.2, 0.2, 0.1]]], dtype=np.float32))
  params = [SamplingParams(logprobs=4)]
  tokens, rows = await constrained.sample(Sampler(), [logits[0]], params, [make_generator(1)], [object()], [bitmask([1, 2], 4)[0]])
  (lp,) = token_logprobs(rows, params, tokens)
  assert tokens[0] == 1 and abs(lp.logprob - np.log(0.5)) < 1e-5  # 0.2 of the 0.4 the grammar allows
  assert [t for t, _ in lp.top] == [1, 2, 0, 3] and lp.top[2][1] == -9999.0 and lp.top[3][1] == -9999.0

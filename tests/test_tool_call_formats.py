"""Mistral's `[TOOL_CALLS]` and Llama 3's JSON tool calls, each for a checkpoint whose own chat template uses it: a
forced call is constrained to the format, parsed back and returned as OpenAI tool_calls, and the call and its result
go back through the template for the next turn. The checkpoints have random weights (a Mistral-shaped one with
`[TOOL_CALLS]` and `[ARGS]` as control tokens, as Mistral's tokenizers have them), so only the grammar makes their
calls; their templates are written for these tests in the shape of those families' templates."""
import json

import pytest

from exo.api.tool_formats import Llama3Format, MistralArgsFormat, MistralFormat, format_for
from tests.support.api_server import ApiServer, openai_client, post_json
from tests.support.checkpoints import random_llama, served_checkpoints, with_mistral_tokens, write_hf_dir

pytestmark = pytest.mark.model

# Mistral 7B v0.3's shape: tools offered before the last user turn, calls as a JSON list after [TOOL_CALLS], results
# in [TOOL_RESULTS], and call ids of 9 letters and digits or the template refuses the conversation.
MISTRAL_TEMPLATE = """{%- for message in messages %}
{%- if message['role'] == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message['content'] }}[/INST]
{%- elif message['role'] == 'tool' %}
{%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
[TOOL_RESULTS] {"content": {{ message['content'] | tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message['role'] == 'assistant' and message.tool_calls %}[TOOL_CALLS] [
{%- for call in message.tool_calls %}
{%- if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}{% if not loop.last %}, {% endif %}
{%- endfor %}]{{ eos_token }}
{%- elif message['role'] == 'assistant' %} {{ message['content'] }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""
# Mistral Small 3.2's: each call `[TOOL_CALLS]name[ARGS]{...}`.
MISTRAL_ARGS_TEMPLATE = MISTRAL_TEMPLATE.replace(
  """[TOOL_CALLS] [
{%- for call in message.tool_calls %}""", """
{%- for call in message.tool_calls %}[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}
{%- endfor %}{{ eos_token }}
{%- for call in [] %}""")
# Llama 3.1's shape: the ipython environment, calls as one JSON object with "parameters", results as ipython turns.
LLAMA3_TEMPLATE = """{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython
Respond with a JSON function call {"name": function name, "parameters": dictionary of argument name and its value}.
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages %}
{%- if message['role'] in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>

{{ message['content'] }}<|eot_id|>
{%- elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.parameters | tojson }}}{% endfor %}<|eot_id|>
{%- else %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# An enum, so that a model of random weights, which rambles inside any free string, ends its call.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                                                                     "required": ["a"]}}}
FORMATS = {"mistral": MistralFormat, "mistral-args": MistralArgsFormat, "llama3": Llama3Format}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
  root = tmp_path_factory.mktemp("tool-formats")
  config, weights, tokenizer = random_llama(2)
  paths = [with_mistral_tokens(write_hf_dir(root / "mistral", config, weights, tokenizer, split=False, model_type="mistral", chat_template=MISTRAL_TEMPLATE)),
           with_mistral_tokens(write_hf_dir(root / "mistral-args", config, weights, tokenizer, split=False, model_type="mistral",
                                            chat_template=MISTRAL_ARGS_TEMPLATE)),
           write_hf_dir(root / "llama3", config, weights, tokenizer, split=False, chat_template=LLAMA3_TEMPLATE)]
  with served_checkpoints() as local:
    models = dict(zip(FORMATS, local.serve([str(p) for p in paths], [str(root)])))
    server = ApiServer("numpy", default_model=models["mistral"]).start()
    try:
      yield server, models
    finally:
      server.stop()


async def chat(url: str, body: dict):
  return await post_json(url, "/v1/chat/completions", body)


@pytest.mark.parametrize("name", list(FORMATS))
async def test_a_forced_call_comes_back_parsed_from_the_templates_format(api, name):
  server, models = api
  tokenizer = server.call(server.api.core.profiles.get(models[name]))[0]
  assert type(format_for(tokenizer)) is FORMATS[name]  # read from the checkpoint's own template
  question = [{"role": "user", "content": "Weather in Paris?"}]
  status, reply = await chat(server.url, {"model": models[name], "messages": question, "tools": [WEATHER, ADD], "max_tokens": 60, "temperature": 0, "logprobs": True,
                                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
  assert status == 200, reply
  choice = reply["choices"][0]
  raw = "".join(t["token"] for t in choice["logprobs"]["content"])
  calls = choice["message"]["tool_calls"]
  assert choice["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_weather"], (raw, reply)
  arguments = json.loads(calls[0]["function"]["arguments"])
  assert arguments["city"] in ("Paris", "Rome")
  # The model wrote the call in its family's own format, which is what was parsed.
  expected = {"mistral": f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {calls[0]["function"]["arguments"]}}}]',
              "mistral-args": f'[TOOL_CALLS]get_weather[ARGS]{calls[0]["function"]["arguments"]}',
              "llama3": f'{{"name": "get_weather", "parameters": {calls[0]["function"]["arguments"]}}}'}[name]
  assert raw.startswith(expected), (raw, expected)
  if name.startswith("mistral"):
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum(), calls[0]["id"]
  # The next turn: the call and its result go back through the template (a client's own ids too: Mistral's are mapped).
  for call_id in (calls[0]["id"], "call_from_another_client_0001"):
    turn = question + [{"role": "assistant", "content": None, "tool_calls": [{**calls[0], "id": call_id}]},
                       {"role": "tool", "tool_call_id": call_id, "content": "Sunny, 24 C"}]
    status, reply = await chat(server.url, {"model": models[name], "messages": turn, "tools": [WEATHER], "max_tokens": 3, "temperature": 0})
    assert status == 200, reply


@pytest.mark.parametrize("name", ["mistral", "mistral-args"])
def test_the_openai_client_streams_mistral_calls(api, name):
  server, models = api
  client = openai_client(server)
  stream = client.chat.completions.create(model=models[name], messages=[{"role": "user", "content": "Add something"}], tools=[WEATHER, ADD],
                                          tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0, stream=True)
  names, arguments = [], ""
  for chunk in stream:
    for delta in chunk.choices[0].delta.tool_calls or []:
      if delta.function.name:
        names.append(delta.function.name)
      arguments += delta.function.arguments or ""
  assert len(names) == 1 and names[0] in ("get_weather", "add"), names
  assert set(json.loads(arguments)) == ({"city"} if names[0] == "get_weather" else {"a"})

"""A Qwen-shaped checkpoint (qwen2 with q/k/v biases, random weights, SmolLM2's vocabulary) served with a chat
template of Qwen's shape in its own tokenizer_config.json: the API's prompt is that template's, and a forced tool
call comes back through the template's `<tool_call>` format, parsed."""
import json

import aiohttp
import jinja2
import pytest

from exo.api.tool_formats import HermesFormat, format_for
from tests.support.api_server import ApiServer
from tests.support.checkpoints import random_qwen2, served_checkpoints, write_hf_dir

pytestmark = pytest.mark.model

# ChatML with Qwen 2.5's way of offering tools: their signatures in the system message, calls asked for inside
# <tool_call></tool_call>. Written for this test (the checkpoint's own template is what matters, not its wording).
QWEN_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call one or more functions. Their signatures, within <tools></tools>:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each call, return a JSON object with the function's name and arguments within <tool_call></tool_call> tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] != 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and not tools %}<|im_start|>system
{{ message['content'] }}<|im_end|>
{% elif message['role'] == 'user' %}<|im_start|>user
{{ message['content'] }}<|im_end|>
{% elif message['role'] == 'assistant' %}<|im_start|>assistant
{{ message['content'] or '' }}
{%- for call in message.get('tool_calls') or [] %}
<tool_call>
{"name": "{{ call['function']['name'] }}", "arguments": {{ call['function']['arguments'] if call['function']['arguments'] is string else call['function']['arguments'] | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message['role'] == 'tool' %}<|im_start|>user
<tool_response>
{{ message['content'] }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# An enum, so that a model of random weights, which rambles inside any free string, ends its call.
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
  root = tmp_path_factory.mktemp("qwen")
  config, weights, tokenizer = random_qwen2(2)
  path = write_hf_dir(root / "qwen-shaped", config, weights, tokenizer, split=False, model_type="qwen2", chat_template=QWEN_TEMPLATE)
  with served_checkpoints() as local:
    model = local.serve([str(path)], [str(root)])[0]
    server = ApiServer("numpy", default_model=model).start()
    try:
      yield server, model, tokenizer
    finally:
      server.stop()


async def chat(url: str, body: dict):
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as response:
      return response.status, await response.json()


async def test_the_prompt_is_the_checkpoints_own_template(api):
  server, model, tokenizer = api
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  status, reply = await chat(server.url, {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0})
  assert status == 200, reply
  ours = jinja2.Environment().from_string(QWEN_TEMPLATE).render(messages=messages, tools=None, add_generation_prompt=True)
  assert ours.startswith("<|im_start|>system\nYou are a helpful assistant.")  # SmolLM2's own template says otherwise
  assert ours != tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert reply["usage"]["prompt_tokens"] == len(tokenizer.encode(ours))


async def test_a_forced_tool_call_comes_back_parsed_from_its_tool_call_tags(api):
  server, model, _ = api
  status, reply = await chat(server.url, {"model": model, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER],
                                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 60, "temperature": 0})
  assert status == 200, reply
  calls = reply["choices"][0]["message"]["tool_calls"]
  assert reply["choices"][0]["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_weather"], reply
  assert json.loads(calls[0]["function"]["arguments"])["city"] in ("Paris", "Rome")
  assert isinstance(format_for(server.call(server.api.core.profiles.get(model))[0]), HermesFormat)  # read from <tool_call> tags

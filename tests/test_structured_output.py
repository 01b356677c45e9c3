"""Structured output and tool calls end to end: the real SmolLM2 on the numpy engine behind the real HTTP API, batching
on (rows sampled inside their step, masks computed beside it). Answers never carry an end token's text; every
finished answer of a subset of the schema suite validates, greedy and sampled, and greedy ones equal those of a node
without batching; tool calls come back in OpenAI's shapes, streamed and not, and go back into the next prompt; bad
fields are 400s; and unmodified clients (openai's parse, langchain-openai, instructor, pydantic-ai) get their
objects."""
import asyncio
import json

import aiohttp
import jsonschema
import pytest
from pydantic import BaseModel, Field

from exo.orchestration.batching.config import BatchingConfig
from tests.support.api_server import ApiServer, openai_client, shared_server
from tests.support.schema_suite import SCHEMAS, SUBSET, prompt
from tests.test_structured_units import BAD_INPUTS, WEATHER

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server():
  server = ApiServer("numpy", batching=BatchingConfig(32)).start()
  yield server
  server.stop()


@pytest.fixture(scope="module")
def client(server):
  return openai_client(server)


class Person(BaseModel):
  name: str = Field(max_length=24)
  age: int = Field(ge=0, le=120)


class Weather(BaseModel):
  """The weather in a city."""
  city: str


def schema_format(name: str) -> dict:
  return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


async def post_all(url: str, bodies):
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
    async def one(body):
      async with session.post(f"{url}/v1/chat/completions", json={"model": MODEL, **body}) as response:
        return response.status, await response.json()
    return await asyncio.gather(*[one(b) for b in bodies])


def test_answers_never_carry_the_end_token_and_usage_counts_it(client):
  ask = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 40}
  reply = client.chat.completions.create(**ask, n=2)
  for choice in reply.choices:
    assert "<|im_end|>" not in choice.message.content and "<|endoftext|>" not in choice.message.content and choice.message.content
  streamed = [chunk.choices[0] for chunk in client.chat.completions.create(**ask, stream=True)]
  assert streamed[-1].finish_reason == "stop" and "<|im_end|>" not in "".join(c.delta.content or "" for c in streamed)
  assert "".join(c.delta.content or "" for c in streamed) == reply.choices[0].message.content
  assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens == 2 * len(streamed)  # the end token counted, per choice
  text = client.completions.create(model=MODEL, prompt="<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n", max_tokens=40)
  assert text.choices[0].finish_reason == "stop" and "<|im_end|>" not in text.choices[0].text


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.95}], ids=["greedy", "sampled"])
def test_every_finished_answer_of_the_schema_subset_validates(server, sampling):
  jobs = [(name, which) for name in SUBSET for which in (0, 1)]
  replies = asyncio.run(post_all(server.url, [{"messages": [{"role": "user", "content": prompt(name, which)}], "max_tokens": 256, "seed": i,
                                               "response_format": schema_format(name), **sampling} for i, (name, which) in enumerate(jobs)]))
  finished = 0
  for (name, _), (status, reply) in zip(jobs, replies):
    assert status == 200, reply
    choice = reply["choices"][0]
    if choice["finish_reason"] == "stop":
      finished += 1
      jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[name])
  assert finished >= 0.9 * len(jobs)


def test_greedy_constrained_answers_are_the_same_batched_and_alone(server):
  names = ["order", "defs_tree", "nullable_name"]
  bodies = [{"messages": [{"role": "user", "content": prompt(n, 0)}], "max_tokens": 96, "temperature": 0, "response_format": schema_format(n)} for n in names]
  batched = [reply["choices"][0]["message"]["content"] for _, reply in asyncio.run(post_all(server.url, bodies))]
  alone = [reply["choices"][0]["message"]["content"] for _, reply in asyncio.run(post_all(shared_server("numpy").url, bodies))]
  assert batched == alone


def test_bad_structured_fields_are_400s_naming_them_and_never_5xx(server):
  bodies = [{"messages": [{"role": "user", "content": "hi"}], **fields} for fields, _ in BAD_INPUTS]
  for (status, reply), (_, param) in zip(asyncio.run(post_all(server.url, bodies)), BAD_INPUTS):
    assert status == 400 and reply["error"]["param"] == param, reply


def test_tool_calls_in_openais_shapes_streamed_and_not(client):
  ask = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER], "max_tokens": 60}
  reply = client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False)
  choice = reply.choices[0]
  assert choice.finish_reason == "tool_calls" and choice.message.content is None and len(choice.message.tool_calls) == 1
  call = choice.message.tool_calls[0]
  assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
  assert isinstance(json.loads(call.function.arguments), dict)
  chunks = [c.choices[0] for c in client.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False, stream=True)]
  deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
  assert deltas[0].id.startswith("call_") and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
  assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:]) and len(deltas) > 2  # arguments in fragments
  assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments and chunks[-1].finish_reason == "tool_calls"
  # The call and its result go back into the prompt; the next answer is text.
  follow = client.chat.completions.create(model=MODEL, max_tokens=40, tools=[WEATHER], messages=ask["messages"] + [
    {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'}], tool_choice="none")
  assert follow.choices[0].message.tool_calls is None and follow.choices[0].message.content
  named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_weather"}})
  assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_weather"]


def test_unmodified_clients_get_their_objects(server, client):
  base = f"{server.url}/v1"
  ask = [{"role": "user", "content": "Describe a person."}]
  assert isinstance(client.chat.completions.parse(model=MODEL, messages=ask, response_format=Person, max_tokens=80).choices[0].message.parsed, Person)

  from langchain_openai import ChatOpenAI
  llm = ChatOpenAI(model=MODEL, base_url=base, api_key="exo", max_tokens=80, temperature=0, max_retries=0)
  assert isinstance(llm.with_structured_output(Person).invoke("Describe a person."), Person)  # json_schema
  assert isinstance(llm.with_structured_output(Person, method="function_calling").invoke("Describe a person."), Person)
  calls = llm.bind_tools([Weather], tool_choice="Weather").invoke("What is the weather in Paris?").tool_calls
  assert [c["name"] for c in calls] == ["Weather"] and isinstance(calls[0]["args"]["city"], str)

  import instructor
  import openai
  for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
    patched = instructor.from_openai(openai.OpenAI(base_url=base, api_key="exo", max_retries=0), mode=mode)
    assert isinstance(patched.chat.completions.create(model=MODEL, response_model=Person, messages=ask, max_tokens=80, max_retries=0), Person)

  from pydantic_ai import Agent
  from pydantic_ai.models.openai import OpenAIChatModel
  from pydantic_ai.providers.openai import OpenAIProvider
  agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base, api_key="exo")), output_type=Person, retries=0)
  assert isinstance(agent.run_sync("Describe a person.", model_settings={"max_tokens": 80, "temperature": 0}).output, Person)

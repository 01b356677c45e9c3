"""Structured output that ends, against a real node (SmolLM2 on the numpy engine, batching on) and unmodified
clients: the forced tool call with a number that ran until the context was full ends, valid, within 64 tokens
without a max_tokens (and pydantic-ai's `output_type` gets its object); instructor's TOOLS mode, openai's `parse` with max_tokens 96 and json_object with max_tokens 48 get
complete JSON that matches, closed within the budget (finish_reason then still "stop" / "tool_calls")."""
import json

import pytest
from pydantic import BaseModel

from tests.support.api_server import openai_client

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server(numpy_server):
  return numpy_server


@pytest.fixture(scope="module")
def client(server):
  return openai_client(server)


class City(BaseModel):
  name: str
  country: str
  population_millions: float


class Facts(BaseModel):
  city: str
  country: str
  facts: list[str]
  landmarks: list[str]


ASK = "Tell me about Paris: its country, its population and many facts and landmarks."


CITY_TOOL = {"type": "function", "function": {"name": "final_result", "parameters": {"type": "object", "properties": {
  "name": {"type": "string"}, "country": {"type": "string"}, "population_millions": {"type": "number"}},
  "required": ["name", "country", "population_millions"], "additionalProperties": False}}}
RUNS_AWAY = "Tell me about Paris."  # without bounds SmolLM2 writes population_millions 1000000... until the context is full


def test_the_forced_call_with_a_number_is_valid_within_64_tokens(client):
  reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": RUNS_AWAY}], tools=[CITY_TOOL], tool_choice="required",
                                         parallel_tool_calls=False, temperature=0)
  assert reply.choices[0].finish_reason == "tool_calls" and reply.usage.completion_tokens < 64
  City.model_validate_json(reply.choices[0].message.tool_calls[0].function.arguments)


def test_pydantic_ais_output_type_with_a_number_ends(server):
  from pydantic_ai import Agent
  from pydantic_ai.models.openai import OpenAIChatModel
  from pydantic_ai.providers.openai import OpenAIProvider
  agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="exo")), output_type=City, retries=0)
  result = agent.run_sync(RUNS_AWAY, model_settings={"temperature": 0})
  assert isinstance(result.output, City)
  # pydantic-ai allows parallel calls: the model repeats its call, at most MAX_CALLS times, each bounded.
  from exo.api.tool_formats import MAX_CALLS
  assert result.usage.output_tokens < 64 * MAX_CALLS, (result.usage, result.output)


def test_instructors_tools_mode_gets_its_object_within_a_small_budget(server):
  import instructor
  import openai
  patched = instructor.from_openai(openai.OpenAI(base_url=f"{server.url}/v1", api_key="exo", max_retries=0), mode=instructor.Mode.TOOLS)
  for max_tokens in (48, 96):
    facts = patched.chat.completions.create(model=MODEL, response_model=Facts, messages=[{"role": "user", "content": ASK}], max_tokens=max_tokens,
                                            max_retries=0, temperature=0)
    assert isinstance(facts, Facts)


def test_parse_with_max_tokens_96_gets_its_object(client):
  reply = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ASK}], response_format=Facts, max_tokens=96, temperature=0)
  assert isinstance(reply.choices[0].message.parsed, Facts) and reply.choices[0].finish_reason == "stop"
  assert reply.usage.completion_tokens <= 96


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "sampled"])
def test_json_object_with_max_tokens_48_parses(client, sampling):
  reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK + " Answer in JSON."}], max_tokens=48,
                                         response_format={"type": "json_object"}, **sampling)
  assert isinstance(json.loads(reply.choices[0].message.content), dict) and reply.usage.completion_tokens <= 48
  assert reply.choices[0].finish_reason == "stop"

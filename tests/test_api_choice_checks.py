"""The fields beyond one plain answer on the dummy engine, where nothing needs a model: bad values of logprobs,
top_logprobs, n and the /v1/completions fields are 400s naming the field, through raw HTTP and the official client;
each choice of a request takes an admission place of its own and a client that leaves ends every choice."""
import aiohttp
import openai
import pytest

from exo.api.settings import ApiSettings
from tests.support.api_server import SlowEngine, shared_server
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def dummy():
  return shared_server("dummy")


async def post(url, body):
  async with aiohttp.ClientSession() as session:
    async with session.post(url, json=body) as r:
      return r.status, await r.json()


COMPLETION_BAD_VALUES = [
  ({}, "prompt"), ({"prompt": 5}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": ["ok", ""]}, "prompt[1]"),
  ({"prompt": ["ok", 3]}, "prompt[1]"), ({"prompt": [1, -2]}, "prompt"), ({"prompt": [1, True]}, "prompt"), ({"prompt": [[1], [2, "x"]]}, "prompt[1]"),
  ({"prompt": [[]]}, "prompt[0]"), ({"prompt": [5, 1000]}, "prompt"), ({"prompt": "x", "logprobs": 21}, "logprobs"),
  ({"prompt": "x", "logprobs": True}, "logprobs"), ({"prompt": "x", "logprobs": 2, "echo": True}, "logprobs"), ({"prompt": "x", "n": 0}, "n"),
  ({"prompt": "x", "n": 17}, "n"), ({"prompt": ["a"] * 9, "n": 2}, "n"), ({"prompt": ["a"] * 17}, "prompt"), ({"prompt": "x", "echo": "yes"}, "echo"),
  ({"prompt": "x", "max_completion_tokens": 5}, "max_completion_tokens"), ({"prompt": "x", "suffix": "y"}, "suffix"),
  ({"prompt": "x", "best_of": 3}, "best_of"), ({"prompt": "x", "messages": []}, "messages"),
]


@pytest.mark.parametrize("body,param", COMPLETION_BAD_VALUES)
@pytest.mark.asyncio
async def test_bad_completion_values_are_400_naming_the_field(dummy, body, param):
  status, reply = await post(f"{dummy.url}/v1/completions", {"model": "dummy", **body})
  assert status == 400 and reply["error"]["param"] == param, reply


@pytest.mark.asyncio
async def test_bad_completion_values_are_400_through_the_client(dummy):
  async with openai.AsyncOpenAI(base_url=f"{dummy.url}/v1", api_key="exo", max_retries=0) as client:
    for kwargs, param in [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"), ({"n": 0}, "n"), ({"n": 17}, "n")]:
      with pytest.raises(openai.BadRequestError) as e:
        await client.chat.completions.create(model="dummy", messages=FRANCE, **kwargs)
      assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
      await client.completions.create(model="dummy", prompt="x", logprobs=3, echo=True)
    assert e.value.body["param"] == "logprobs"


# --- admission ---

@pytest.mark.asyncio
async def test_each_choice_takes_a_place_and_leaves_it_when_it_ends(make_server):
  s = make_server(SlowEngine(delay=0.02), settings=ApiSettings(max_running=1, max_queued=2))
  url = f"{s.url}/v1/chat/completions"
  status, reply = await post(url, {"model": "dummy", "messages": FRANCE, "n": 4})
  assert status == 400 and reply["error"]["param"] == "n" and "at most 3 requests" in reply["error"]["message"]
  # Three choices over one running place: they run one after another, none waits for a place another holds.
  status, reply = await post(url, {"model": "dummy", "messages": FRANCE, "n": 3})
  assert status == 200 and [c["index"] for c in reply["choices"]] == [0, 1, 2]
  assert all(c["message"]["content"] == "dummy" * 10 for c in reply["choices"])
  assert s.api.admission.held == 0 and s.api.admission.running == 0


@pytest.mark.asyncio
async def test_a_client_leaving_ends_every_choice(make_server):
  s = make_server(SlowEngine(delay=0.2))
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{s.url}/v1/chat/completions", json={"model": "dummy", "messages": FRANCE, "n": 3, "stream": True}) as r:
      assert r.status == 200
      await r.content.readline()  # the first chunk
      await eventually(lambda: len(s.node.requests) == 3)
  await eventually(lambda: len(s.node.requests) == 0 and s.api.admission.held == 0)

"""A real node keeps its embedding model loaded beside its chat model and unloads it after its keep-alive, on a fake
clock: /api/ps, /v1/state and Ollama's client and keep_alive (the pool alone: tests/test_embeddings_pool.py)."""
import aiohttp
import ollama
import pytest

from tests.support.api_server import ApiServer

pytestmark = pytest.mark.model  # loads all-MiniLM-L6-v2


@pytest.fixture(scope="module")
def node():
  server = ApiServer("dummy").start()
  yield server
  server.stop()


async def get(url: str):
  async with aiohttp.ClientSession() as session:
    async with session.get(url) as r:
      return await r.json()


class FakeClock:
  now = 1000.0

  def __call__(self) -> float:
    return self.now


async def test_a_node_shows_its_embedding_model_beside_its_chat_model_until_its_keep_alive_runs_out(node):
  clock = FakeClock()
  pool = node.api.core.embeddings.pool
  pool.clock = clock
  client = ollama.AsyncClient(host=node.url, timeout=120)
  await client.chat(model="dummy", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2})
  await client.embed(model="all-minilm", input="hello", keep_alive="10m")
  ps = (await client.ps()).models
  assert [m.model for m in ps] == ["dummy:latest", "all-minilm-l6-v2:latest"] and ps[1].context_length == 256
  state = await get(f"{node.url}/v1/state")
  assert [(m["model"], m["expires_in_s"]) for m in state["embedding_models"]] == [("all-minilm-l6-v2", 600)]
  await client.embed(model="all-minilm", input=["more", "texts"])  # no keep_alive: the model stays, for the node's default
  clock.now += 299
  assert [m["model"] for m in (await get(f"{node.url}/v1/state"))["embedding_models"]] == ["all-minilm-l6-v2"]
  clock.now += 1
  assert (await get(f"{node.url}/v1/state"))["embedding_models"] == []
  assert [m.model for m in (await client.ps()).models] == ["dummy:latest"]
  await client.embed(model="all-minilm", input="hello", keep_alive=0)  # Ollama's "unload when done"
  assert (await get(f"{node.url}/v1/state"))["embedding_models"] == [] and pool.loads == 2

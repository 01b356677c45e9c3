"""Embedding models stay loaded beside the chat model and are unloaded after their keep-alive, on a fake clock: the
pool alone with a stand-in loader (no weights needed to see what is loaded when), then a real node's /api/ps and
/v1/state as Ollama's client and keep_alive drive them."""
import asyncio
import math
import threading

import aiohttp
import ollama
import pytest

from exo.embeddings.pool import EmbeddingPool
from tests.support.api_server import ApiServer

pytestmark = pytest.mark.model  # the node's part loads all-MiniLM-L6-v2


class FakeClock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self) -> float:
    return self.now


class StandInModel:
  dimensions, max_tokens = 4, 8


def pool_with(clock, keep_alive=300.0, fail_first=False):
  loads = []

  def load(model_id):
    loads.append(model_id)
    if fail_first and len(loads) == 1:
      raise OSError("disk error")
    return StandInModel()
  return EmbeddingPool(load, keep_alive, clock), loads


async def test_a_model_is_loaded_once_and_unloaded_after_its_keep_alive():
  clock = FakeClock()
  pool, loads = pool_with(clock)
  async with pool.use("m") as first:
    clock.now += 1000  # in use: never unloaded, whatever the time
    assert pool.sweep() == [] and pool.describe()[0]["expires_in_s"] is None
  async with pool.use("m") as again:
    assert again is first
  clock.now += 299
  assert pool.sweep() == [] and pool.describe()[0]["expires_in_s"] == pytest.approx(1)
  clock.now += 1
  assert pool.describe() == [] and loads == ["m"]
  async with pool.use("m"):
    pass
  assert loads == ["m", "m"] and pool.loads == 2
  pool.close()


async def test_a_requests_keep_alive_wins_zero_unloads_at_once_negative_never():
  clock = FakeClock()
  pool, _ = pool_with(clock)
  async with pool.use("a", keep_alive=math.inf):
    pass
  async with pool.use("b", keep_alive=0.0):
    pass
  async with pool.use("c", keep_alive=60.0):
    pass
  assert [m["model"] for m in pool.describe()] == ["a", "c"]  # b went as its request ended
  clock.now += 10**9
  assert [m["model"] for m in pool.describe()] == ["a"] and pool.describe()[0]["expires_in_s"] is None
  pool.close()


async def test_concurrent_first_uses_share_one_load_and_a_failed_load_is_tried_again():
  clock = FakeClock()
  pool, loads = pool_with(clock, fail_first=True)
  with pytest.raises(OSError):
    async with pool.use("m"):
      pass
  release = threading.Event()
  original = pool.load
  pool.load = lambda model_id: (release.wait(30), original(model_id))[1]

  async def use():
    async with pool.use("m") as model:
      return model
  users = [asyncio.ensure_future(use()) for _ in range(5)]
  await asyncio.sleep(0)
  release.set()
  models = await asyncio.gather(*users)
  assert loads == ["m", "m"] and all(m is models[0] for m in models) and pool.loads == 1
  pool.close()


@pytest.fixture(scope="module")
def node():
  server = ApiServer("dummy").start()
  yield server
  server.stop()


async def get(url: str):
  async with aiohttp.ClientSession() as session:
    async with session.get(url) as r:
      return await r.json()


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

"""The embedding pool keeps each model loaded while requests use it and unloads it after its keep-alive, on a fake
clock; a stand-in loader (no weights needed to see what is loaded when). tests/test_embeddings_keep_alive.py drives a
real node's the same way."""
import asyncio
import math
import threading

import pytest

from exo.embeddings.pool import EmbeddingPool

pytestmark = pytest.mark.unit


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
  loading, release = threading.Event(), threading.Event()
  original = pool.load
  pool.load = lambda model_id: (loading.set(), release.wait(30), original(model_id))[2]

  async def use():
    async with pool.use("m") as model:
      return model
  users = [asyncio.ensure_future(use()) for _ in range(5)]
  assert await asyncio.to_thread(loading.wait, 30)  # the first user's load is under way; the others join it
  release.set()
  models = await asyncio.gather(*users)
  assert loads == ["m", "m"] and all(m is models[0] for m in models) and pool.loads == 1
  pool.close()

"""Run-ahead's grants (exo/orchestration/steps/ahead.py) stay revocable while the loop's step awaits the step started
ahead: a row that arrives meanwhile stops the chain, so the next step takes it in, and a request that ends meanwhile
is not chained. (The engine is a stand-in that only holds the started step open: what is tested is the bookkeeping.)"""
import asyncio

import numpy as np
import pytest

from exo.inference.shard import Shard
from exo.orchestration.steps.ahead import RunAhead

pytestmark = pytest.mark.unit

SHARD = Shard("m", 0, 0, 1)


class HeldEngine:
  """start_ahead's step ends when the test says so; the ticket it was given is kept to read what it would chain."""
  def __init__(self):
    self.results, self.ticket = None, None

  def start_ahead(self, shard, items, ticket):
    self.results, self.ticket = asyncio.get_running_loop().create_future(), ticket
    return self.results


async def started_and_taken(ahead: RunAhead, engine: HeldEngine):
  rows = [("a", np.array([[1]])), ("b", np.array([[2]]))]
  assert ahead.start(engine, SHARD, rows, follow={"a": frozenset({0}), "b": frozenset({0})})
  taking = asyncio.ensure_future(ahead.call(engine, SHARD, [(rid, tensor, None) for rid, tensor in rows]))  # the loop's step takes them
  assert not ahead.rows and set(ahead.taken) == {"a", "b"}
  return taking


async def test_a_row_arriving_while_the_started_step_runs_revokes_its_grant():
  ahead, engine = RunAhead(True), HeldEngine()
  taking = await started_and_taken(ahead, engine)
  ahead.revoke()
  assert engine.ticket.end() == {}
  engine.results.set_result([(np.zeros(3), None), (np.zeros(3), None)])
  assert len(await taking) == 2 and not ahead.taken


async def test_a_request_ending_while_the_started_step_runs_is_not_chained():
  ahead, engine = RunAhead(True), HeldEngine()
  taking = await started_and_taken(ahead, engine)
  ahead.forget("a")
  assert set(engine.ticket.end()) == {"b"}
  engine.results.set_result([(np.zeros(3), None), (np.zeros(3), None)])
  await taking
  assert not ahead.taken

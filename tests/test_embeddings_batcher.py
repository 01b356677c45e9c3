"""The embedding batcher: inputs queued while a pass runs go together in the next, in batches bounded by padded
tokens, each request getting its own vectors back in order; a failing pass fails only its requests, a cancelled
request's inputs are not run, a full queue refuses. The encoder is a stand-in (a vector of each input's ids) so the
tests see exactly which inputs ran together; tests/test_embeddings_model.py checks the real one."""
import asyncio
import ctypes.util
import os
import subprocess
import sys
import threading
import types

import numpy as np
import pytest

from exo.api.embeddings import shortened
from exo.embeddings.batcher import BUSY_BATCH_TOKENS, EmbeddingBatcher, EmbeddingQueueFull
from exo.inference.numpy import kernels
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit


class StandIn:
  """Each pass recorded; `gate`, when set, holds a pass until the test opens it."""

  def __init__(self, fail_on=None):
    self.passes, self.fail_on = [], fail_on
    self.entered, self.gate = threading.Event(), threading.Event()
    self.gate.set()

  def embed(self, inputs, workers=None, pause=lambda: None):
    self.passes.append([list(i) for i in inputs])
    self.cores = workers.cores
    self.entered.set()
    self.gate.wait(30)
    if self.fail_on is not None and any(self.fail_on in i for i in inputs):
      raise ValueError("bad input")
    return np.array([[float(i[0]), float(len(i))] for i in inputs], dtype=np.float32)


async def wait_for(event: threading.Event):
  assert await asyncio.to_thread(event.wait, 30)


async def held_first_pass(batcher: EmbeddingBatcher, model: StandIn, first_id: int = 1) -> asyncio.Future:
  """A first request whose pass is held (the worker is inside it), so what is sent next queues behind it."""
  model.gate.clear()
  first = asyncio.ensure_future(batcher.embed(model, [[first_id]]))
  await wait_for(model.entered)
  return first


async def queued(batcher: EmbeddingBatcher, inputs: int) -> None:
  """Until the requests sent meanwhile have queued this many inputs."""
  await eventually(lambda: batcher.queued_inputs == inputs, 10, f"{inputs} inputs queued")


async def release(batcher: EmbeddingBatcher, model: StandIn, first: asyncio.Future, inputs: int) -> None:
  await queued(batcher, inputs)
  model.gate.set()
  await first


async def test_requests_queued_during_a_pass_run_together_in_the_next():
  batcher, model = EmbeddingBatcher(), StandIn()
  first = await held_first_pass(batcher, model)
  others = [asyncio.ensure_future(batcher.embed(model, [[i], [i, i]])) for i in range(2, 33)]
  await release(batcher, model, first, 62)
  results = await asyncio.gather(first, *others)
  assert len(model.passes) == 2 and len(model.passes[1]) == 62  # 31 requests, two inputs each, in one pass
  assert results[0].tolist() == [[1, 1]]
  for i, vectors in zip(range(2, 33), results[1:]):
    assert vectors.tolist() == [[i, 1], [i, 2]]  # each request's own, in its order
  batcher.close()


async def test_a_pass_holds_at_most_batch_tokens_padded_tokens_shortest_first():
  batcher, model = EmbeddingBatcher(batch_tokens=7), StandIn()
  first = await held_first_pass(batcher, model, 9)
  lengths = [4, 1, 2, 1, 3]
  rest = asyncio.ensure_future(batcher.embed(model, [[n] * n for n in lengths]))
  await release(batcher, model, first, len(lengths))
  assert [v[1] for v in (await rest).tolist()] == lengths
  later = model.passes[1:]
  assert [[len(i) for i in p] for p in later] == [[1, 1, 2], [3], [4]]  # rows x longest <= 7
  batcher.close()


async def test_a_failing_pass_fails_its_requests_only():
  batcher, model = EmbeddingBatcher(batch_tokens=1), StandIn(fail_on=7)
  first = await held_first_pass(batcher, model)
  bad, good = asyncio.ensure_future(batcher.embed(model, [[7], [8]])), asyncio.ensure_future(batcher.embed(model, [[5]]))
  await release(batcher, model, first, 3)
  with pytest.raises(ValueError):
    await bad
  assert (await good).tolist() == [[5, 1]]
  assert (await batcher.embed(model, [[6]])).tolist() == [[6, 1]]  # the worker goes on
  assert [8] not in [i for p in model.passes for i in p]  # the rest of a failed request is not run
  batcher.close()


async def test_a_cancelled_request_is_not_run_and_a_full_queue_refuses():
  batcher, model = EmbeddingBatcher(max_queued_inputs=3), StandIn()
  first = await held_first_pass(batcher, model)
  cancelled = asyncio.ensure_future(batcher.embed(model, [[2], [3]]))
  await queued(batcher, 2)
  with pytest.raises(EmbeddingQueueFull):
    await batcher.embed(model, [[4], [5]])  # 1 running + 2 queued + 2 > 3
  cancelled.cancel()
  await release(batcher, model, first, 0)  # the cancelled request's inputs leave the queue
  assert (await batcher.embed(model, [[4], [5]])).tolist() == [[4, 1], [5, 1]]  # room again
  assert all([2] not in p for p in model.passes)
  batcher.close()


async def test_while_chat_runs_passes_keep_to_their_own_thread_and_stay_small():
  chatting = False
  batcher, model = EmbeddingBatcher(busy=lambda: chatting, busy_share=1.0), StandIn()  # share 1: no pause between passes
  await batcher.embed(model, [[1] * 10] * 20)
  assert model.cores == kernels.CORES and len(model.passes) == 1  # its own helpers, one per extra core (never the engine's)
  chatting = True
  await batcher.embed(model, [[1] * 10] * 20)
  assert model.cores == 1 and [len(p) for p in model.passes[1:]] == [BUSY_BATCH_TOKENS // 10] * (200 // BUSY_BATCH_TOKENS) + [200 % BUSY_BATCH_TOKENS // 10]
  batcher.close()


async def test_a_long_inputs_pieces_leave_chat_the_cores_once_it_begins():
  chatting = False
  batcher = EmbeddingBatcher(busy=lambda: chatting)
  waits = []
  batcher.stopping = types.SimpleNamespace(wait=waits.append, set=lambda: None)  # the pauses recorded, not slept

  class Pieces(StandIn):
    """A pass in pieces (as a decoder runs a long input), chat beginning after the first."""

    def embed(self, inputs, workers=None, pause=lambda: None):
      nonlocal chatting
      pause()
      assert waits == []  # no chat yet: the pieces run on
      chatting = True
      pause()
      return super().embed(inputs, workers)
  model = Pieces()
  await batcher.embed(model, [[1] * 600])
  assert len(waits) == 1 and model.cores == kernels.CORES  # it gave way once chat had begun, within the pass
  batcher.close()


async def test_closing_ends_what_waits_with_an_error():
  batcher, model = EmbeddingBatcher(), StandIn()
  first = await held_first_pass(batcher, model)
  waiting = asyncio.ensure_future(batcher.embed(model, [[2]]))
  await queued(batcher, 1)
  batcher.close()
  model.gate.set()
  await first
  with pytest.raises(RuntimeError, match="stopping"):
    await waiting


def test_shortened_vectors_are_cut_and_back_to_unit_length():
  vectors = np.array([[3.0, 4.0, 12.0]], dtype=np.float32) / 13
  cut = shortened(vectors, 2)
  assert np.allclose(cut, [[0.6, 0.8]])
  assert shortened(vectors, 3) is vectors


NUMPY_BLAS_THREADS = """
import ctypes, glob, os, sys
import numpy
system = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # as the MLX engine loads it on Linux
bundled = glob.glob(os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs", "*openblas*"))
if not bundled:
  print("no-bundled")
  sys.exit()
ours = ctypes.CDLL(bundled[0])
system.openblas_set_num_threads(2)
ours.scipy_openblas_set_num_threads64_(2)
from exo.embeddings.batcher import EmbeddingBatcher
EmbeddingBatcher().close()
print(ours.scipy_openblas_get_num_threads64_(), system.openblas_get_num_threads())
"""


def test_the_batcher_runs_numpys_blas_on_one_thread_and_leaves_a_system_openblas_alone():
  """Its helpers share a pass's products; OpenBLAS threads beside them made passes several times slower. A system
  OpenBLAS another engine binds to (MLX on Linux) keeps its threads. In a child process: the tests' conftest sets
  OPENBLAS_NUM_THREADS=1, which the batcher respects."""
  system = ctypes.util.find_library("openblas")
  if system is None:
    pytest.skip("no system OpenBLAS to load beside numpy's")
  env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
  out = subprocess.run([sys.executable, "-c", NUMPY_BLAS_THREADS, system], env=env, capture_output=True, text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  if out.stdout.strip() == "no-bundled":
    pytest.skip("numpy uses the system's BLAS here: the two are one library")
  assert out.stdout.split() == ["1", "2"]

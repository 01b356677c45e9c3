"""Embedding requests run together: one worker thread per API takes every input queued when it is free and runs
them as padded batches, so 32 requests arriving together cost a few encoder passes instead of 32.

An embedding is a prompt's pass alone (no KV cache, no sampling, no ring): it runs here, on the node whose API got
the request, on a thread of its own beside the engine's, so chat steps never wait for an embedding batch nor an
embedding for a chat step. A pass shares its products among helper threads of its own (one per extra core), never
the engine's; while the node has chat requests (`busy()`), it runs on its one thread instead, leaving the other
cores to the engine's steps, in small passes with pauses between them. numpy's OpenBLAS runs on one thread, as in
the numpy engine: its own threads beside the helpers made a decoder embedder's passes 2-5x slower on 2 cores.

A batch holds at most `batch_tokens` padded tokens (inputs sorted by length, so little of that is padding), which
bounds one pass; a decoder model runs an input longer than that in pieces (exo/embeddings/decoder.py) and pauses
between them as between passes."""
import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, List, Optional, Sequence

import numpy as np

from exo.embeddings.model import EmbeddingModel
from exo.inference.numpy.kernels import Workers, single_threaded_blas

# Padded tokens per encoder pass (2 inputs of 256 tokens, 16 of 32): products of 512 rows run as fast per row as
# larger ones, and a short pass is soon over when a chat request arrives and the passes must shrink.
BATCH_TOKENS = 512
# While the node has chat requests: passes this small (a few ms each), on one thread, taking at most this share of the
# time. On a 2-core VM a chat stream measured 0.6x its speed alone beside passes on their one thread with no pause
# (the cores share caches and memory bandwidth, and a thread more competes for them and for the GIL).
BUSY_BATCH_TOKENS = 256
BUSY_SHARE = 0.2
MAX_QUEUED_INPUTS = 16384  # beyond this the node is busy (429), not slowly drowning


class EmbeddingQueueFull(Exception):
  pass


@dataclass
class Job:
  model: EmbeddingModel
  inputs: Sequence[Sequence[int]]
  done: Callable[[Optional[np.ndarray], Optional[BaseException]], None]  # called on the worker thread
  vectors: Optional[np.ndarray] = None
  cancelled: bool = False
  left: int = field(init=False)  # inputs whose vectors are still to come
  queued: int = field(init=False)  # inputs not yet taken into a pass (counted in the batcher's queued_inputs)

  def __post_init__(self):
    self.left = self.queued = len(self.inputs)


class EmbeddingBatcher:
  def __init__(self, batch_tokens: int = BATCH_TOKENS, max_queued_inputs: int = MAX_QUEUED_INPUTS, busy: Callable[[], bool] = lambda: False,
               busy_share: float = BUSY_SHARE):
    self.batch_tokens, self.max_queued_inputs, self.busy, self.busy_share = batch_tokens, max_queued_inputs, busy, busy_share
    self.stopping = threading.Event()  # cuts a pause short
    self.workers = Workers()  # its own, not the engine's: a pass never holds the helpers a chat step shares its work on
    self.alone = Workers(cores=1)  # while chat runs: the pass's own thread only
    self.jobs: Deque[Job] = deque()
    self.queued_inputs = 0
    self.wake = threading.Condition()
    self.closed = False
    self.thread: Optional[threading.Thread] = None
    single_threaded_blas(numpy_only=True)

  async def embed(self, model: EmbeddingModel, inputs: Sequence[Sequence[int]]) -> np.ndarray:
    """(inputs, dimensions) vectors, run in batches with whatever else is queued. Cancelling drops the inputs not yet run."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def done(vectors, error):
      loop.call_soon_threadsafe(lambda: future.done() or (future.set_exception(error) if error else future.set_result(vectors)))
    job = Job(model, inputs, done)
    with self.wake:
      if self.closed:
        raise RuntimeError("the embedding batcher is closed")
      if self.queued_inputs + len(inputs) > self.max_queued_inputs:
        raise EmbeddingQueueFull(f"{self.queued_inputs} inputs are waiting to be embedded on this node (at most {self.max_queued_inputs})")
      self.queued_inputs += len(inputs)
      self.jobs.append(job)
      if self.thread is None:
        self.thread = threading.Thread(target=self._run, daemon=True, name="exo-embeddings")
        self.thread.start()
      self.wake.notify()
    try:
      return await future
    finally:
      self._drop(job)  # a no-op once done; else the worker skips what is left of it, and its room in the queue is free now

  def close(self) -> None:
    with self.wake:
      self.closed = True
      self.stopping.set()
      self.wake.notify()

  def _run(self) -> None:
    while True:
      with self.wake:
        while not self.jobs and not self.closed:
          self.wake.wait()
        jobs = list(self.jobs)
        self.jobs.clear()
      if self.closed:  # the API is stopping: what waits ends with an error, never hangs
        for job in jobs:
          job.done(None, RuntimeError("the node is stopping"))
        return
      for model in dict.fromkeys(job.model for job in jobs):
        group = [job for job in jobs if job.model is model]
        try:
          self._run_together(group)
        except Exception as e:  # a fault outside a pass fails its requests; the worker goes on
          self._fail(group, e)

  def _fail(self, jobs: List[Job], error: Exception) -> None:
    for job in jobs:
      self._drop(job)
      job.done(None, error)

  def _run_together(self, jobs: List[Job]) -> None:
    """Every input of these jobs (one model's), shortest first, in batches of at most batch_tokens padded tokens."""
    rows = sorted(((len(ids), job, i) for job in jobs for i, ids in enumerate(job.inputs)), key=lambda row: row[0])
    while rows:
      busy = self.busy()
      limit = min(self.batch_tokens, BUSY_BATCH_TOKENS) if busy else self.batch_tokens
      take = 1
      while take < len(rows) and rows[take][0] * (take + 1) <= limit:
        take += 1
      with self.wake:
        batch, rows = [r for r in rows[:take] if not r[1].cancelled], rows[take:]
        for _, job, _ in batch:
          job.queued -= 1
        self.queued_inputs -= len(batch)
      if not batch:
        continue
      started = [time.monotonic()]

      def give_way(busy: bool = True) -> None:
        """Leave the cores to chat for the rest of the time: a pass may use BUSY_SHARE of it. Also called between the
        pieces of a long input's pass (a decoder's), where chat may have begun since the pass did."""
        if busy and self.busy():
          self.stopping.wait((time.monotonic() - started[0]) * (1 / self.busy_share - 1))
        started[0] = time.monotonic()
      try:
        vectors = batch[0][1].model.embed([job.inputs[i] for _, job, i in batch], self.alone if busy else self.workers, give_way)
      except Exception as e:  # the jobs in this batch fail; the worker goes on
        self._fail(list({id(job): job for _, job, _ in batch}.values()), e)
        continue
      finally:
        give_way(busy)
      for (_, job, i), vector in zip(batch, vectors):
        if job.vectors is None:
          job.vectors = np.empty((len(job.inputs), len(vector)), dtype=np.float32)
        job.vectors[i] = vector
        job.left -= 1
        if job.left == 0 and not job.cancelled:
          job.done(job.vectors, None)

  def _drop(self, job: Job) -> None:
    with self.wake:
      job.cancelled = True
      self.queued_inputs -= job.queued
      job.queued = 0


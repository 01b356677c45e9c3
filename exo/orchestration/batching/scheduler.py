"""Continuous batching at one node, for one shard: iteration-level scheduling as in Orca (OSDI'22) and vLLM.

Every engine step takes the requests that are ready for this shard, oldest first, up to the batch size: decode
tokens, and chunks of new prompts up to `prefill_chunk` prompt tokens per step, or 2 per decode row when that is
more (so a long prompt shares steps with running streams instead of freezing them). One `engine.infer_batch` call
runs them all; each request then gets its own output and carries on exactly as unbatched. Requests join and leave
between steps; each keeps its own KV cache in the engine.

A step starts at once when the batch is full or no request is on its way back to this shard; a lone request never
waits. Otherwise it waits for the requests a step of this shard handed back, which come back for their next token
(see `_start_by`)."""
import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from exo.inference.shard import Shard
from exo.orchestration.batching.batcher import BatcherStopped, BatchStats
from exo.orchestration.forward_started import FORWARD_STARTED, announce
from exo.orchestration.requests import RequestEnded

GATHER_LIMIT = 4  # a batch handed on may gather for up to this many timeouts, while its messages keep coming
ROUND_TRIP_SLACK = 1.5  # the first layers' node waits for a request up to this many typical round trips
ROUND_TRIPS_KEPT = 32  # recent round trips the typical one is the median of
LONE_PROMPT_CHUNK = 512  # prompt tokens per step when no running stream is here (bounds a step's attention memory)
RUNNING_AFTER = 4  # decode steps after which a request's stream is running, and prompt chunks protect it
PROMPT_TOKENS_PER_DECODE_ROW = 2  # beside D decode rows a step takes up to max(prefill_chunk, 2 D) prompt tokens


@dataclass(eq=False)
class Job:
  """One request's pending forward pass. A prompt longer than a chunk runs in several steps."""
  request_id: str
  tensor: np.ndarray  # what is still to run: chunks are cut off its front
  state: Optional[dict]
  future: asyncio.Future
  since: float = field(default_factory=time.monotonic)  # ready since
  outputs: List[np.ndarray] = field(default_factory=list)  # hidden states of earlier chunks, joined at the end
  started: Optional[asyncio.Future] = field(default_factory=FORWARD_STARTED.get)  # announced with its first step

  @property
  def length(self) -> int:
    """Positions this job still has to run, when its input is a (1, L, ...) sequence that can be split."""
    shape = np.shape(self.tensor)
    return shape[1] if len(shape) >= 2 and shape[0] == 1 else 1


class Scheduler:
  def __init__(self, engine, shard: Shard, batch_size: int, timeout_s: float, prefill_chunk: int, engine_lock: asyncio.Lock,
               is_live: Callable[[str], bool] = lambda request_id: False, delivered: Callable[[str], None] = lambda request_id: None):
    self.engine, self.shard, self.batch_size, self.timeout_s, self.prefill_chunk = engine, shard, batch_size, timeout_s, prefill_chunk
    self.engine_lock, self.is_live, self.delivered = engine_lock, is_live, delivered
    self.ready: Dict[str, Job] = {}  # insertion order = readiness order
    self.away: Dict[str, float] = {}  # handed back by a step and still going (sampled, or round the ring): since when
    self.decodes: Dict[str, int] = {}  # single-position steps each live request has had here, until forget()
    self.round_trips: deque = deque(maxlen=ROUND_TRIPS_KEPT)  # seconds from handed back to ready again
    self.stats = BatchStats()  # requests per engine step
    self._due = asyncio.Event()  # set when the next step may start
    self._due_timer: Optional[asyncio.TimerHandle] = None
    self._loop_task: Optional[asyncio.Task] = None
    self._idle_since = time.monotonic()
    self._stopped = False

  async def infer(self, request_id: str, tensor: np.ndarray, state: Optional[dict]) -> Tuple[np.ndarray, Optional[dict]]:
    if self._stopped:
      raise BatcherStopped("batching has stopped on this node")
    if request_id in self.ready:
      raise RuntimeError(f"request {request_id} is already waiting for a step on {self.shard}")
    left = self.away.pop(request_id, None)
    if left is not None:
      self.round_trips.append(time.monotonic() - left)
    future = asyncio.get_running_loop().create_future()
    self.ready[request_id] = Job(request_id, tensor, state, future)
    if self._loop_task is None:
      self._loop_task = asyncio.get_running_loop().create_task(self._run())
    self.poke()
    return await future

  def forget(self, request_id: str) -> None:
    """The request has ended on this node: it leaves the line (a prompt between two of its chunks too) and will not
    come back."""
    self.decodes.pop(request_id, None)
    job = self.ready.pop(request_id, None)
    if job is not None and not job.future.done():
      job.future.set_exception(RequestEnded(request_id))
    if self.away.pop(request_id, None) is not None or job is not None:
      self.poke()

  def poke(self) -> None:
    """Something changed (a request became ready or went away): look again when the next step can start.

    This only re-arms a timer: in a burst of arrivals (a batch handed on by the previous node comes as one message
    per request) the loop task wakes once, when the step is due, not once per message."""
    if self._due_timer is not None:
      self._due_timer.cancel()
      self._due_timer = None
    if not self.ready and not self._stopped:
      return
    delay = self._start_by() - time.monotonic()
    if delay <= 0:
      self._due.set()
    else:
      self._due_timer = asyncio.get_running_loop().call_later(delay, self._due.set)

  def _start_by(self) -> float:
    """When the next step starts at the latest (monotonic time).

    At once if the batch is full or no request is away. Otherwise ready work waits for the requests that are away,
    up to `timeout_s` after the engine fell idle or the latest request became ready, and at most GATHER_LIMIT
    timeouts after the first: a batch handed on by the previous node arrives one message per request (prompts' big
    messages several ms apart), and gathers here while its messages keep coming. When only new tokens are ready,
    the node of the first layers, where every request's next token starts, also waits for each away request up to
    ROUND_TRIP_SLACK typical round trips from when it left: the requests then travel the ring as one batch instead
    of splitting into groups, each of which would pay for reading all the weights. (A prompt chunk is work enough
    for a step of its own.) A request away longer than that is late and holds nobody up."""
    now = time.monotonic()
    if self._stopped or len(self.ready) >= self.batch_size or not self.away:
      return now
    first = max(next(iter(self.ready.values())).since, self._idle_since)
    latest = max(next(reversed(self.ready.values())).since, self._idle_since)
    start_by = min(latest + self.timeout_s, first + GATHER_LIMIT * self.timeout_s)
    if self.shard.is_first_layer() and self.round_trips and all(job.length == 1 for job in self.ready.values()):
      typical = sorted(self.round_trips)[len(self.round_trips) // 2]
      start_by = max(start_by, max(self.away.values()) + ROUND_TRIP_SLACK * typical)
    return start_by

  async def _run(self) -> None:
    while not self._stopped:
      try:
        await self._next_step()
      except Exception as e:  # a bug here must not leave every waiting request hanging: they end with it
        for job in self.ready.values():
          if not job.future.done():
            job.future.set_exception(e)
        self.ready.clear()
    for job in self.ready.values():
      if not job.future.done():
        job.future.set_exception(BatcherStopped("node stopping"))
    self.ready.clear()

  async def _next_step(self) -> None:
    await self._due.wait()
    self._due.clear()
    for request_id in [r for r, job in self.ready.items() if job.future.done()]:
      del self.ready[request_id]  # its caller has gone
    if self.ready and not self._stopped and self._start_by() <= time.monotonic():
      await self._step(self._pick())
    self.poke()

  def _pick(self) -> List[Tuple[Job, int]]:
    """(job, positions to run now), oldest first: decode rows whole, prompts in chunks within the step's budget.

    Chunks protect running streams, those past RUNNING_AFTER tokens here. With none here (a lone prompt, or a burst of
    requests that arrived together) prompts run in chunks of up to LONE_PROMPT_CHUNK tokens: a burst then starts
    decoding together in full steps, instead of its last prompts trickling in while the first ones decode."""
    running = any(self.decodes.get(request_id, 0) >= RUNNING_AFTER for request_id in [*self.ready, *self.away])
    if running and self.prefill_chunk:
      # A chunk stalls the step's streams by its share of the step: with many decode rows the step is long anyway,
      # and a chunk that grows with them stalls them no more than prefill_chunk stalls a few, while the prompts
      # of a burst of requests start instead of waiting behind 24-token chunks for tens of seconds.
      decode_rows = min(self.batch_size, sum(1 for job in self.ready.values() if job.length == 1))
      budget = max(self.prefill_chunk, PROMPT_TOKENS_PER_DECODE_ROW * decode_rows)
    else:
      budget = (self.prefill_chunk if running else max(self.prefill_chunk, LONE_PROMPT_CHUNK)) or float("inf")
    rows = []
    for job in self.ready.values():
      if len(rows) >= self.batch_size:
        break
      take = job.length
      if take > 1:
        if budget <= 0:
          continue
        take = int(min(take, budget))
        budget -= take
      rows.append((job, take))
    return rows

  async def _step(self, rows: List[Tuple[Job, int]]) -> None:
    # A prompt part-way through its chunks keeps its place in line; everything else leaves the line now.
    for job, take in rows:
      if take == job.length:
        del self.ready[job.request_id]
      if job.length == 1:
        self.decodes[job.request_id] = self.decodes.get(job.request_id, 0) + 1
    items = [(job.request_id, job.tensor if take == job.length else job.tensor[:, :take], job.state) for job, take in rows]
    self.stats.record(len(items))
    try:
      async with self.engine_lock:  # one step at a time on this engine, whatever the shard
        live = [i for i, (job, _) in enumerate(rows) if not job.future.done()]  # a request may have ended meanwhile
        rows, items = [rows[i] for i in live], [items[i] for i in live]
        for job, _ in rows:
          announce(job.started)  # its reply goes out when this task yields: for our engines, once their thread has the step
        results = list(await self.engine.infer_batch(self.shard, items)) if items else []
      if len(results) != len(items):
        raise RuntimeError(f"engine step of {len(items)} requests returned {len(results)} results")
    except asyncio.CancelledError:  # only when the event loop itself is torn down
      for job, _ in rows:
        self.ready.pop(job.request_id, None)
        job.future.cancel()
      raise
    except Exception as e:  # the whole step failed: each of its requests learns why
      results = [e] * len(items)
    self._idle_since = time.monotonic()
    for (job, take), result in zip(rows, results):
      try:
        if isinstance(result, BaseException):
          raise result
        self._deliver(job, take, result)
      except Exception as e:  # this request ends with its error; the others carry on
        self.ready.pop(job.request_id, None)
        if not job.future.done():
          job.future.set_exception(e)

  def _deliver(self, job: Job, take: int, result: Tuple[np.ndarray, Optional[dict]]) -> None:
    if job.future.done():  # its caller has gone
      self.ready.pop(job.request_id, None)
      return
    output, job.state = result
    if take < job.length:  # a prompt chunk: nothing is sampled or forwarded until the last one
      if not self.shard.is_last_layer():
        job.outputs.append(output)
      job.tensor = job.tensor[:, take:]
      return
    if job.outputs:
      output = np.concatenate(job.outputs + [output], axis=1)
    job.future.set_result((output, job.state))
    if self.is_live(job.request_id):
      self.away[job.request_id] = self._idle_since
      self.delivered(job.request_id)
    else:
      self.decodes.pop(job.request_id, None)

  async def stop(self) -> None:
    """Let the step under way finish (nothing cancels it), then fail the requests still waiting."""
    self._stopped = True
    self.poke()
    if self._loop_task is not None:
      await asyncio.gather(self._loop_task, return_exceptions=True)
    for job in self.ready.values():
      if not job.future.done():
        job.future.set_exception(BatcherStopped("node stopping"))
    self.ready.clear()

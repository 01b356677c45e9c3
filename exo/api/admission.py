"""Admission control for one API node: at most `max_running` requests are served at once and `max_queued` more
wait for a place, in arrival order; beyond that a request is refused with 429 and a Retry-After. A waiting
request is also held back while the KV memory it would need does not fit, beside the running ones', in the
node's budget. A request counts as waiting from the moment it is accepted (its prompt is being tokenised), and a
waiting request whose client leaves gives up its place."""
import asyncio
import math
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import AsyncIterator, Deque, List, Optional

from exo.api.errors import ApiError, BadRequest

RETRY_AFTER_MAX_S = 60


class Ticket:
  """One accepted request's place: waiting until `admit` returns, running from then until the place is left."""

  def __init__(self, admission: "Admission"):
    self.admission = admission
    self.kv_bytes = 0
    self.future: Optional[asyncio.Future] = None
    self.started: Optional[float] = None  # when it began to run
    self.left = False

  async def admit(self, kv_bytes: int) -> None:
    """Wait for a running place and room for `kv_bytes` of KV cache."""
    admission = self.admission
    admission.kv_budget_check(kv_bytes)
    self.kv_bytes = kv_bytes
    self.future = asyncio.get_running_loop().create_future()
    admission.queue.append(self)
    admission.admit_waiting()
    await self.future

  def leave(self) -> None:
    """Give the place up (at once, or when its request ends: whichever comes first)."""
    if not self.left:
      self.left = True
      self.admission.held -= 1
      self.admission._leave(self)


class Admission:
  def __init__(self, max_running: int, max_queued: int, kv_budget: int):
    self.max_running, self.max_queued, self.kv_budget = max_running, max_queued, kv_budget
    self.held = 0  # accepted requests not yet finished: running or waiting
    self.running = 0
    self.kv_in_use = 0
    self.queue: Deque[Ticket] = deque()  # waiting for admit(), oldest first
    self.typical_run_s = 1.0  # moving average of how long a request runs, for Retry-After

  def kv_budget_check(self, kv_bytes: int, param: str = "max_tokens") -> None:
    """BadRequest if a request could need more KV memory than the whole budget: it would wait forever. `param` is
    the request's name for its reply's token budget."""
    if kv_bytes > self.kv_budget:
      raise BadRequest(f"this request could need {kv_bytes / 2**20:,.0f} MiB of KV cache, more than this node's whole budget of "
                       f"{self.kv_budget / 2**20:,.0f} MiB (EXO_KV_BUDGET_MB); ask for fewer {param} or a shorter prompt",
                       param=param, code="kv_budget_exceeded")

  @property
  def waiting(self) -> int:
    return self.held - self.running

  def full(self) -> bool:
    return self.held >= self.max_running + self.max_queued

  def retry_after(self) -> int:
    """Seconds until a place is likely free: the waiting requests ahead, at the pace running ones finish."""
    return max(1, min(RETRY_AFTER_MAX_S, math.ceil(self.typical_run_s * (self.waiting + 1) / max(1, self.running))))

  @asynccontextmanager
  async def place(self) -> AsyncIterator[Ticket]:
    """A place for one request, or ApiError 429 when every place is taken."""
    async with self.places(1) as tickets:
      yield tickets[0]

  @asynccontextmanager
  async def places(self, count: int) -> AsyncIterator[List[Ticket]]:
    """`count` places at once (a request's choices, each served as a request of its own; each may leave its place
    early), or ApiError 429 when they are not all free; BadRequest naming `n` if this node could never hold them."""
    if count > self.max_running + self.max_queued:
      raise BadRequest(f"this request has {count} choices; this node serves at most {self.max_running + self.max_queued} requests, running "
                       f"and waiting (EXO_MAX_CONCURRENT_REQUESTS + EXO_MAX_QUEUED_REQUESTS)", param="n")
    if self.held + count > self.max_running + self.max_queued:
      raise ApiError(429, f"this node is at its limit: {self.running} requests running (EXO_MAX_CONCURRENT_REQUESTS={self.max_running}) "
                          f"and {self.waiting} waiting (EXO_MAX_QUEUED_REQUESTS={self.max_queued}); try again shortly",
                     code="too_many_requests", headers={"Retry-After": str(self.retry_after())})
    tickets = [Ticket(self) for _ in range(count)]
    self.held += count
    try:
      yield tickets
    finally:
      for ticket in tickets:
        ticket.leave()

  def _leave(self, ticket: Ticket) -> None:
    if ticket.started is not None:
      self.running -= 1
      self.kv_in_use -= ticket.kv_bytes
      self.typical_run_s += 0.2 * (time.monotonic() - ticket.started - self.typical_run_s)
    elif ticket in self.queue:  # its client left while it waited
      self.queue.remove(ticket)
    self.admit_waiting()

  def admit_waiting(self) -> None:
    """Start waiting requests in order while a place and KV room are free (a request never overtakes an older one)."""
    while self.queue and self.running < self.max_running:
      ticket = self.queue[0]
      if ticket.future.cancelled():  # cancelled, not yet out of the queue
        self.queue.popleft()
        continue
      if self.kv_in_use + ticket.kv_bytes > self.kv_budget:
        return
      self.queue.popleft()
      ticket.started = time.monotonic()
      self.running += 1
      self.kv_in_use += ticket.kv_bytes
      ticket.future.set_result(None)

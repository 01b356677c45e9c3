"""Steps an engine chains on its own thread: a step the step loop starts ahead (orchestration/steps/ahead.py) carries
a Ticket, on which the loop may grant, before the step ends, a follow: the requests whose next token is their greedy
one (the argmax of their logits, as sampling draws it), each with the tokens that would end it. At the end of the step
the engine draws those tokens itself and queues the next step of those rows at once (`chained`), so the step does not
wait for the event loop to sample and hand it back; the loop samples the same token meanwhile and takes the step's
result as it would take a step it started."""
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

import numpy as np


@dataclass
class Chained:
  rows: List[Tuple[str, np.ndarray, None]]  # request id, its greedy token (1, 1), no state
  results: Future  # the step's results, in the order of `rows`
  ticket: "Ticket"


class Ticket:
  def __init__(self) -> None:
    self._lock = threading.Lock()  # the loop grants and revokes while the engine's thread ends the step
    self._ended = False
    self._follow: Dict[str, FrozenSet[int]] = {}
    self.chained: Optional[Chained] = None  # set by the engine's thread before the step's results are handed back

  def grant(self, follow: Dict[str, FrozenSet[int]]) -> bool:
    """Request id -> the tokens that end it: their next step follows this one at once. False if it has ended."""
    with self._lock:
      if not self._ended:
        self._follow = dict(follow)
      return not self._ended

  def revoke(self, request_id: Optional[str] = None) -> None:
    """The request (every one, None) does not follow this step."""
    with self._lock:
      if request_id is None:
        self._follow = {}
      else:
        self._follow.pop(request_id, None)

  def end(self) -> Dict[str, FrozenSet[int]]:
    """On the engine's thread as the step ends: what follows it (nothing can be granted after)."""
    with self._lock:
      self._ended = True
      return self._follow


def greedy_tokens(items, results, follow: Dict[str, FrozenSet[int]]) -> List[Tuple[str, np.ndarray, None]]:
  """The next rows of a step's granted requests: each one's argmax token, unless it ends the request."""
  rows = []
  for (request_id, _, _), result in zip(items, results):
    ends = follow.get(request_id)
    if ends is None or isinstance(result, BaseException) or result is None:
      continue
    token = int(np.argmax(np.asarray(result[0], dtype=np.float32).reshape(-1)))  # as sampling.sample_rows draws a greedy row (ties: the lowest id)
    if token not in ends:
      rows.append((request_id, np.array([[token]], dtype=np.int64), None))
  return rows

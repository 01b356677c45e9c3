"""How many micro-batches keep a ring of stages working, from what the steps are measured to take.

With m groups one behind the other round a ring of p stages, each stage works on one group while the others are
elsewhere; but a step costs a fixed part (reading the weights) plus a part per row, and m groups pay the fixed part m
times. One round of N rows takes at least each stage's busy time (m * fixed + per_row * N) and one group's round trip
(the stages' steps for N / m rows plus the hops): the best m makes the larger bound smallest."""
import math
from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional, Sequence, Tuple

MOST_GROUPS_PER_STAGE = 2  # m at most this many times the ring's stages
STEPS_FITTED = 64  # recent decode steps the fit of a stage's step time is taken over
BUSY_WINDOW_S = 10.0  # the busy fraction is measured over this long


@dataclass(frozen=True)
class StepCost:
  """A stage's step time as fixed_s + per_row_s * rows (decode steps, one position per row)."""
  fixed_s: float
  per_row_s: float

  def __call__(self, rows: float) -> float:
    return self.fixed_s + self.per_row_s * rows


def round_time(groups: int, rows: int, stages: Sequence[StepCost], hops_s: float) -> float:
  """The longer of the two bounds above: how long every row takes to go round once."""
  per_group = math.ceil(rows / groups)
  busiest = max(groups * s.fixed_s + s.per_row_s * rows for s in stages)
  one_group = sum(s(per_group) for s in stages) + hops_s
  return max(busiest, one_group)


def best_groups(rows: int, stages: Sequence[StepCost], hops_s: float) -> int:
  """The m from 1 to min(rows, MOST_GROUPS_PER_STAGE * stages) with the shortest round; the fewer groups on a tie."""
  most = max(1, min(rows, MOST_GROUPS_PER_STAGE * len(stages)))
  return min(range(1, most + 1), key=lambda m: (round_time(m, rows, stages, hops_s), m))


class StageTimes:
  """What this stage's steps took: a least-squares fit of decode steps' time by rows, and how busy it has been."""

  def __init__(self) -> None:
    self.decode_steps: Deque[Tuple[int, float]] = deque(maxlen=STEPS_FITTED)  # (rows, seconds)
    self.busy: Deque[Tuple[float, float]] = deque()  # (start, end) of recent steps
    self.first_start: Optional[float] = None
    self.busy_total_s = 0.0
    self._fit: Optional[StepCost] = None  # cost()'s answer until the next decode step (it is asked at every schedule)

  def record(self, start: float, end: float, rows: int, decode_only: bool) -> None:
    if self.first_start is None:
      self.first_start = start
    self.busy_total_s += end - start
    self.busy.append((start, end))
    while self.busy and self.busy[0][1] < end - BUSY_WINDOW_S:
      self.busy.popleft()
    if decode_only:
      self.decode_steps.append((rows, end - start))
      self._fit = None

  def busy_fraction(self, now: float) -> float:
    """The share of the last BUSY_WINDOW_S (or of the time since the first step, if shorter) spent in steps."""
    if self.first_start is None:
      return 0.0
    since = max(now - BUSY_WINDOW_S, self.first_start)
    busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end in self.busy)
    return min(1.0, busy / max(now - since, 1e-9))

  def cost(self) -> Optional[StepCost]:
    """The fitted step cost, once decode steps of at least two different sizes have been seen."""
    if self._fit is not None or len({rows for rows, _ in self.decode_steps}) < 2:
      return self._fit
    n = len(self.decode_steps)
    mean_rows = sum(r for r, _ in self.decode_steps) / n
    mean_s = sum(s for _, s in self.decode_steps) / n
    spread = sum((r - mean_rows) ** 2 for r, _ in self.decode_steps)
    per_row = max(0.0, sum((r - mean_rows) * (s - mean_s) for r, s in self.decode_steps) / spread)
    self._fit = StepCost(max(0.0, mean_s - per_row * mean_rows), per_row)
    return self._fit

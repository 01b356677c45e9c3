"""Continuous batching at one node for one shard, as a policy: `schedule(now)` says what the next engine step runs,
`update(step, results, now)` takes what it returned. Nothing here waits or touches the engine (tests drive it with a
fake clock).

A step takes ready requests, oldest first, up to the batch size: decode tokens, and prompts in chunks, so a long prompt
shares steps with running streams instead of freezing them.

Micro-batches: the node with the first layers splits its requests into m groups (micro_batches.py) that travel the
ring one behind the other; a group's step starts once its live members are back, or ROUND_TRIP_SLACK typical round
trips after the late ones were due. The other stages take a packed message (a whole step of the stage before) at once,
and gather single messages (upstream nodes send one per request) for up to `timeout_s` after the latest arrival
(GATHER_LIMIT timeouts after the first), unless none of the rows they handed back is due within the wait."""
import math
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from exo.inference.shard import Shard
from exo.orchestration.steps.micro_batches import StageTimes, StepCost, best_groups
from exo.orchestration.routing.packing import input_length

GATHER_LIMIT = 4  # a burst whose messages keep arriving waits up to this many timeouts after its first
ROUND_TRIP_SLACK = 1.5  # the first layers' node waits for a group's member up to this many typical round trips
ROUND_TRIPS_KEPT = 32  # recent round trips the typical one is the median of
LONE_PROMPT_CHUNK = 512  # prompt tokens per step when no running stream is here (bounds a step's attention memory)
RUNNING_AFTER = 4  # decode steps after which a request's stream is running, and prompt chunks protect it
PROMPT_TOKENS_PER_DECODE_ROW = 2  # beside D decode rows a step takes up to max(prefill_chunk, 2 D) prompt tokens

class BatchStats:
  """How many rows each engine step (or sampling call) carried."""

  def __init__(self) -> None:
    self.sizes: Counter = Counter()

  def record(self, size: int) -> None:
    self.sizes[size] += 1

  @property
  def flushes(self) -> int:
    return sum(self.sizes.values())

  @property
  def mean(self) -> float:
    return sum(size * n for size, n in self.sizes.items()) / max(1, self.flushes)

  def __str__(self) -> str:
    histogram = " ".join(f"{size}:{n}" for size, n in sorted(self.sizes.items()))
    return f"{self.flushes} batches, mean size {self.mean:.2f}, sizes {{{histogram}}}"


Result = Union[Tuple[np.ndarray, Optional[dict]], BaseException]


@dataclass(eq=False)
class Row:
  """One request's pending forward pass here. A prompt longer than a chunk runs in several steps."""
  request_id: str
  tensor: np.ndarray  # what is still to run: chunks are cut off its front
  state: Optional[dict]
  since: float  # ready since
  outputs: List[np.ndarray] = field(default_factory=list)  # hidden states of earlier chunks, joined at the end
  received: int = 0  # positions its input held when it arrived (what its pass adds to its cache here)
  whole: bool = False  # it came in a packed message, a whole step of the stage before: nothing to gather

  @property
  def length(self) -> int:
    return input_length(self.tensor)


@dataclass(eq=False)
class Step:
  """What one engine call runs: each row with the positions it takes now."""
  rows: List[Tuple[Row, int]]
  started: float

  def items(self) -> List[Tuple[str, np.ndarray, Optional[dict]]]:
    return [(row.request_id, row.tensor if take == row.length else row.tensor[:, :take], row.state) for row, take in self.rows]


class Scheduler:
  def __init__(self, shard: Shard, batch_size: int, timeout_s: float, prefill_chunk: int, stages: int = 1):
    self.shard, self.batch_size, self.timeout_s, self.prefill_chunk = shard, batch_size, timeout_s, prefill_chunk
    self.ready: Dict[str, Row] = {}  # insertion order = readiness order
    self.away: Dict[str, float] = {}  # handed back by a step and still going (sampled, or round the ring): since when
    self.group_of: Dict[str, int] = {}  # live requests here -> their group (on the first layers' node)
    self.decodes: Dict[str, int] = {}  # single-position steps each live request has had here
    self.round_trips: deque = deque(maxlen=ROUND_TRIPS_KEPT)  # seconds from handed back to ready again
    self.times = StageTimes()
    self.stats = BatchStats()  # requests per engine step
    self.stages = stages  # stages of the ring (the plugin keeps it current)
    self.other_stages: List[StepCost] = []  # the other stages' step costs, where known
    self.groups = 1  # micro-batches the first layers' node keeps going

  def add(self, request_id: str, tensor: np.ndarray, state: Optional[dict], now: float, whole: bool = False) -> None:
    if request_id in self.ready:
      raise RuntimeError(f"request {request_id} is already waiting for a step on {self.shard}")
    left = self.away.pop(request_id, None)
    if left is not None:
      self.round_trips.append(now - left)
    self.ready[request_id] = Row(request_id, tensor, state, now, received=input_length(tensor), whole=whole)

  def drop(self, request_id: str) -> None:
    """The request has ended here, or its caller has gone: it leaves."""
    for held in (self.decodes, self.away, self.group_of, self.ready):
      held.pop(request_id, None)

  def schedule(self, now: float) -> Optional[Step]:
    """The step to run now, or None (then `due(now)` says when to ask again)."""
    first_layer = self.shard.is_first_layer()
    if first_layer:
      self._plan_groups()
    for _ in range(2):  # a second look if the due group handed all its rows over to a smaller one
      if self.due(now) > now:
        return None
      key, candidates = self._due_group(now)
      rows = self._pick(candidates)
      if rows:
        break
    if not rows:
      return None
    if first_layer:
      for row, _ in rows:
        self.group_of[row.request_id] = key
    return Step(rows, now)

  def due(self, now: float) -> float:
    """When the next step can start at the earliest, if nothing changes (math.inf: no work)."""
    return min((self._due_at(key, rows, now) for key, rows in self._by_group().items()), default=math.inf)

  def update(self, step: Step, results: List[Result], now: float) -> List[Tuple[Row, Result]]:
    """Take a step's results; returns the rows whose whole input has now run (or failed), each with its result."""
    decode_only = all(take == 1 for _, take in step.rows)
    self.times.record(step.started, now, len(step.rows), decode_only)
    self.stats.record(len(step.rows))
    done = []
    for (row, take), result in zip(step.rows, results):
      if self.ready.get(row.request_id) is not row:
        continue  # it ended while the step ran
      if isinstance(result, BaseException):
        self.drop(row.request_id)
        done.append((row, result))
        continue
      if take == 1 and row.length == 1:
        self.decodes[row.request_id] = self.decodes.get(row.request_id, 0) + 1
      output, row.state = result
      if take < row.length:  # a prompt chunk: nothing is sampled or forwarded until the last one
        if not self.shard.is_last_layer():
          row.outputs.append(output)
        row.tensor = row.tensor[:, take:]
        continue
      if row.outputs:
        output = np.concatenate(row.outputs + [output], axis=1)
      del self.ready[row.request_id]
      self.away[row.request_id] = now
      done.append((row, (output, row.state)))
    return done

  def typical_round_trip(self) -> Optional[float]:
    return sorted(self.round_trips)[len(self.round_trips) // 2] if self.round_trips else None

  def hop_estimate(self) -> Optional[float]:
    """Seconds a group spends between stages per round beyond their steps (first layers' node only)."""
    if not self.round_trips or not self.shard.is_first_layer():
      return None
    own = self.times.cost()
    others = self.other_stages or ([own] * (self.stages - 1) if own else None)
    if others is None:
      return None
    per_group = max(1, math.ceil(self._live() / max(1, self.groups)))
    return max(0.0, min(self.round_trips) - sum(cost(per_group) for cost in others))

  def _by_group(self) -> Dict[Optional[int], List[Row]]:
    """The ready rows by group (None: newcomers, and every row off the first layers' node)."""
    groups: Dict[Optional[int], List[Row]] = {}
    for row in self.ready.values():
      groups.setdefault(self.group_of.get(row.request_id), []).append(row)
    return groups

  def _missing(self, key: Optional[int]) -> List[str]:
    """The live members of a group that are not here yet."""
    return [r for r, c in self.group_of.items() if c == key and r not in self.ready]

  def _due_at(self, key: Optional[int], rows: List[Row], now: float) -> float:
    """When the ready rows of one group may start their step."""
    grouped = key is not None and self.shard.is_first_layer()
    if not self.shard.is_first_layer() and all(row.whole for row in rows):
      return now  # each message is a whole batch (see the module's docstring)
    missing = self._missing(key) if grouped else list(self.away)
    if len(rows) >= self.batch_size or not missing:
      return now
    first, latest = min(row.since for row in rows), max(row.since for row in rows)
    start_by = min(latest + self.timeout_s, first + GATHER_LIMIT * self.timeout_s)
    typical = self.typical_round_trip()
    if not grouped and typical is not None and all(self.away[r] + typical > start_by for r in missing):
      # None is due back within the wait (another micro-batch, a step behind): waiting would only delay this step.
      return min(now, start_by)
    if grouped and typical is not None and all(row.length == 1 for row in rows):
      # The group goes round together: waiting for a late member costs less than splitting the group.
      start_by = max(start_by, max(self.away.get(r, now) for r in missing) + ROUND_TRIP_SLACK * typical)
    return start_by

  def _due_group(self, now: float) -> Tuple[Optional[int], List[Row]]:
    """The group whose step is due and its rows, in readiness order: on the first layers' node the due group that has
    waited longest, with newcomers while it has room; elsewhere every ready row."""
    if not self.shard.is_first_layer():
      return None, list(self.ready.values())
    by_group = self._by_group()
    due = {key: rows for key, rows in by_group.items() if self._due_at(key, rows, now) <= now}
    key = min(due, key=lambda k: min(row.since for row in due[k]))
    rows = list(due[key]) if key is not None else []
    if key is None or key >= self.groups:
      sizes = self._group_sizes()
      key = min(sizes, key=sizes.get)
      rows += by_group.get(key, []) if key in due else []
    else:  # a group two or more members larger than the smallest hands its newest ready members over
      for row in reversed(due[key]):
        sizes = self._group_sizes()
        smallest = min(sizes, key=sizes.get)  # (the lowest-numbered of the smallest)
        if sizes[key] - sizes[smallest] < 2:
          break
        self.group_of[row.request_id] = smallest
        rows.remove(row)
    room = math.ceil(self._live() / max(1, self.groups)) - self._group_sizes().get(key, 0)
    newcomers = [row for row in by_group.get(None, []) if row not in rows][:max(1 if not rows else 0, room)]
    take = set(map(id, rows + newcomers))
    return key, [row for row in self.ready.values() if id(row) in take]

  def _live(self) -> int:
    return len(set(self.group_of) | set(self.ready))

  def _group_sizes(self) -> Dict[int, int]:
    members = Counter(self.group_of.values())
    return {g: members[g] for g in range(self.groups)}

  def _plan_groups(self) -> None:
    """m for the live requests, from the measured costs; before there is a fit, one group per stage."""
    if self.stages == 1:  # nothing to keep busy while a group is away: a split would only pay the fixed cost twice
      self.groups = 1
      return
    live, own, hops = self._live(), self.times.cost(), self.hop_estimate()  # (a fit over the steps kept: not on every one-node step)
    if own is None or hops is None:
      self.groups = max(1, min(self.stages, live))
    else:
      self.groups = best_groups(max(1, live), [own, *(self.other_stages or [own] * (self.stages - 1))], hops)

  def _pick(self, candidates: List[Row]) -> List[Tuple[Row, int]]:
    """(row, positions to run now), oldest first: decode rows whole, prompts in chunks within the step's budget. With
    no running stream here, chunks of up to LONE_PROMPT_CHUNK, so a burst starts decoding together in full steps."""
    running = any(self.decodes.get(request_id, 0) >= RUNNING_AFTER for request_id in [*self.ready, *self.away])
    if running and self.prefill_chunk:
      # A chunk that grows with the decode rows stalls many of them no more than prefill_chunk stalls a few.
      decode_rows = min(self.batch_size, sum(1 for row in candidates if row.length == 1))
      budget = max(self.prefill_chunk, PROMPT_TOKENS_PER_DECODE_ROW * decode_rows)
    else:
      budget = (self.prefill_chunk if running else max(self.prefill_chunk, LONE_PROMPT_CHUNK)) or math.inf
    rows = []
    for row in candidates:
      if len(rows) >= self.batch_size:
        break
      take = row.length
      if take > 1:
        if budget <= 0:
          continue
        take = int(min(take, budget))
        budget -= take
      rows.append((row, take))
    return rows

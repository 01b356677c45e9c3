"""The choice of a group for each new request, at its origin. Nothing here waits or sends: the clock is a parameter.

Load: a group's prompt tokens still to compute (less cached prefixes) plus ROW_TOKENS per request, waiting or running
(a row takes a share of every step until its answer ends). Own requests count once sent; other origins' come from
each group's first node (`group_load`). A prompt goes to the group that was sent most of its blocks (see PREFIX_*)
unless that group is loaded past the least loaded one by more than PREFIX_SLACK plus the tokens its cache spares;
otherwise to the least loaded group, ties going to one that contains this node."""
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from exo.inference.prefix_cache import BLOCK, block_keys
from exo.topology.placement import Group

PREFIX_MIN_SHARE = 0.5  # a group's cached blocks must cover at least this share of a prompt's whole blocks
PREFIX_MIN_TOKENS = 64  # and spare it at least this many tokens more than the least loaded group (a shared system prompt does not)
PREFIX_SLACK = 32.0  # load a prefix group may carry beyond the least loaded one's, besides the tokens it saves
ROW_TOKENS = 64  # a request's row weighs as many prompt tokens: one per step it runs, for an answer of typical length
REPORT_S = 0.1  # a group's first node reports its load at most this often (when it changed)
REPORT_FRESH_S = 3.0  # a report is used for this long
KEYS_KEPT = 1 << 16  # block keys remembered per group (least recently sent forgotten first)

LEAST_LOAD, PREFIX, ONLY_GROUP = "least_load", "prefix", "only_group"
REASONS = (PREFIX, LEAST_LOAD, ONLY_GROUP)


@dataclass
class Sent:
  """A request this node routed, until it ends."""
  group: str
  model: str
  prompt_ids: Optional[List[int]]
  waiting: int  # prompt tokens still to compute, until its first token comes back
  answer: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class Choice:
  group: Group
  reason: str
  cached: int  # prompt tokens the group is expected to hold already


class Router:
  def __init__(self, node_id: str, clock: Callable[[], float] = time.monotonic):
    self.node_id, self.clock = node_id, clock
    self.sent: Dict[str, Sent] = {}
    self.reports: Dict[str, Tuple[Dict[str, Tuple[int, int, int]], float]] = {}  # group -> (origin -> its share, heard at)
    self.keys: Dict[str, "OrderedDict[str, None]"] = {}  # group -> block keys sent there, oldest first
    self.routed: Counter = Counter()  # reason -> requests

  def choose(self, groups: Sequence[Group], model: str, prompt_ids: Optional[Sequence[int]]) -> Choice:
    keys = block_keys(model, prompt_ids) if prompt_ids is not None and len(prompt_ids) >= BLOCK else []
    if len(groups) == 1:
      return self._chose(Choice(groups[0], ONLY_GROUP, self._held(groups[0].name, keys) * BLOCK))
    order = {g.name: i for i, g in enumerate(groups)}
    local = {g.name: self.node_id in g.node_ids for g in groups}
    loads = {g.name: self.load(g.name) for g in groups}
    least = min(groups, key=lambda g: (loads[g.name], not local[g.name], order[g.name]))
    held = {g.name: self._held(g.name, keys) for g in groups}
    most = max(held.values(), default=0)
    worth = keys and most * BLOCK >= PREFIX_MIN_TOKENS and most >= PREFIX_MIN_SHARE * len(keys)
    if worth and (most - held[least.name]) * BLOCK >= PREFIX_MIN_TOKENS:
      best = min((g for g in groups if held[g.name] == most), key=lambda g: (loads[g.name], not local[g.name], order[g.name]))
      if loads[best.name] <= loads[least.name] + PREFIX_SLACK + (most - held[least.name]) * BLOCK:
        return self._chose(Choice(best, PREFIX, most * BLOCK))
    if worth and held[least.name] == most:  # the least loaded holds it too
      return self._chose(Choice(least, PREFIX, most * BLOCK))
    return self._chose(Choice(least, LEAST_LOAD, held[least.name] * BLOCK))

  def _chose(self, choice: Choice) -> Choice:
    self.routed[choice.reason] += 1
    return choice

  def _held(self, group: str, keys: List[str]) -> int:
    """Leading blocks of `keys` that were sent to `group`."""
    known = self.keys.get(group, {})
    return next((i for i, key in enumerate(keys) if key not in known), len(keys))

  def sent_to(self, request_id: str, choice: Choice, model: str, prompt_ids: Optional[List[int]], prompt_tokens: int) -> None:
    """Count a request on its group from now on; its prompt's blocks are that group's from now on."""
    self.sent[request_id] = Sent(choice.group.name, model, prompt_ids, max(1, prompt_tokens - choice.cached))
    if prompt_ids is not None:
      self._remember(choice.group.name, block_keys(model, prompt_ids))

  def tokens(self, request_id: str, tokens: Sequence[int], finished: bool) -> None:
    """Tokens of a request this node routed: it is running; once finished its answer's blocks are its group's too."""
    sent = self.sent.get(request_id)
    if sent is None:
      return
    sent.waiting = 0
    if sent.prompt_ids is not None:
      sent.answer += tokens
    if finished:
      del self.sent[request_id]
      if sent.prompt_ids is not None and sent.answer:
        self._remember(sent.group, block_keys(sent.model, sent.prompt_ids + sent.answer))

  def ended(self, request_id: str) -> None:
    """It ended otherwise (failed, cancelled): it no longer counts."""
    self.sent.pop(request_id, None)

  def _remember(self, group: str, keys: List[str]) -> None:
    known = self.keys.setdefault(group, OrderedDict())
    for key in keys:
      known[key] = None
      known.move_to_end(key)
    while len(known) > KEYS_KEPT:
      known.popitem(last=False)

  def report(self, group: str, loads: Dict[str, Tuple[int, int, int]]) -> None:
    """A group's first node says each origin's (prompt tokens waiting, requests running, requests waiting)."""
    self.reports[group] = (loads, self.clock())

  def own(self, group: str) -> Tuple[int, int, int]:
    """(prompt tokens waiting, requests running, requests waiting) this node sent to `group`."""
    return _total((sent.waiting, sent.waiting == 0, sent.waiting > 0) for sent in self.sent.values() if sent.group == group)

  def others(self, group: str) -> Tuple[int, int, int]:
    """The other origins' share of `group`'s work, as last reported (nothing once the report is stale)."""
    loads, heard = self.reports.get(group, ({}, -REPORT_FRESH_S))
    fresh = self.clock() - heard <= REPORT_FRESH_S
    return _total(share for origin, share in loads.items() if fresh and origin != self.node_id)

  def load(self, group: str) -> float:
    tokens, running, waiting = _total([self.own(group), self.others(group)])
    return tokens + ROW_TOKENS * (running + waiting)

  def groups(self) -> Dict[str, Dict[str, int]]:
    """Each group this node sent to or heard of: its requests running and waiting, as this node knows them."""
    view = {}
    for group in sorted(set(self.reports) | {s.group for s in self.sent.values()}):
      _, running, waiting = _total([self.own(group), self.others(group)])
      view[group] = {"running": running, "waiting": waiting}
    return view


def _total(shares: Iterable[Tuple[int, int, int]]) -> Tuple[int, int, int]:
  """The shares summed, field by field."""
  return tuple(map(sum, zip(*shares))) or (0, 0, 0)

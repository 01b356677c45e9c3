"""The router's choice of a group for each new request (exo/orchestration/routing/router.py), on a fake clock: the
least loaded group, counted the moment a request is sent; ties to this node's own group; prefix affinity within its
margin; the other origins' load from reports, until they go stale. And the route a request carries, checked."""
import pytest

from exo.inference.prefix_cache import BLOCK
from exo.orchestration.routing.route import InvalidRoute, Route
from exo.orchestration.routing.router import LEAST_LOAD, ONLY_GROUP, PREFIX, PREFIX_SLACK, REPORT_FRESH_S, ROW_TOKENS, Router
from exo.topology.placement import Group, Stage

pytestmark = pytest.mark.unit

MODEL = "smollm2-135m"
A, B = Group((Stage("a", 0, 29),)), Group((Stage("b", 0, 29),))
PIPE = Group((Stage("c", 0, 18), Stage("d", 19, 29)))


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def send(router: Router, request_id: str, groups, prompt_ids=None, prompt_tokens: int = 64):
  choice = router.choose(groups, MODEL, prompt_ids)
  router.sent_to(request_id, choice, MODEL, prompt_ids, prompt_tokens if prompt_ids is None else len(prompt_ids))
  return choice


def conversation(turn: int, seed: int = 0) -> list:
  """A prompt that starts with the previous turn's prompt and answer (as a chat's next turn does)."""
  return [100 + seed * 1000 + i for i in range(64 * turn)]


def test_ties_go_to_this_nodes_group_and_a_burst_spreads_at_once():
  router = Router("b", Clock())
  assert send(router, "r0", [A, B]).group == B  # both idle: the group that holds this node
  picks = [send(router, f"r{i}", [A, B]).group.name for i in range(1, 9)]
  assert picks == ["a", "b"] * 4  # each send counts at once: the burst alternates before any report arrives
  assert (router.load("a"), router.load("b"), router.routed[LEAST_LOAD]) == (4 * (64 + ROW_TOKENS), 5 * (64 + ROW_TOKENS), 9)


def test_a_request_weighs_its_prompt_until_it_runs_then_one_row_and_once_ended_nothing():
  router = Router("a", Clock())
  send(router, "long", [A, B], prompt_tokens=500)
  assert router.load("a") == 500 + ROW_TOKENS and send(router, "next", [A, B]).group == B
  router.tokens("long", [7], False)  # its first token: running now
  assert router.load("a") == ROW_TOKENS and router.own("a") == (0, 1, 0)
  router.ended("long")
  assert router.load("a") == 0 and send(router, "after", [A, B]).group == A


def test_other_origins_load_counts_until_its_report_is_stale():
  clock = Clock()
  router = Router("a", clock)
  router.report("a", {"b": (0, 10, 0), "a": (0, 99, 0)})  # this node's own share comes from its own counts, not the report
  assert router.load("a") == 10 * ROW_TOKENS and send(router, "r", [A, B]).group == B
  clock.now += REPORT_FRESH_S + 0.1
  assert router.load("a") == 0 and router.others("a") == (0, 0, 0)


def test_a_prompt_goes_to_the_group_that_holds_its_prefix_within_the_margin():
  router = Router("a", Clock())
  first = send(router, "t1", [A, B], conversation(1))
  assert first.group == A
  answer = list(range(64))
  router.tokens("t1", answer, True)  # its answer came back: prompt and answer are that group's blocks now
  for i in range(2):  # the prefix group is busier than the other, within the margin
    send(router, f"busy{i}", [A], prompt_tokens=1)
    router.tokens(f"busy{i}", [1], False)
  assert router.load("a") == 2 * ROW_TOKENS and router.load("b") == 0
  second = send(router, "t2", [A, B], conversation(1) + answer + [5] * 32)  # the next turn holds the first one and its answer
  assert second.group == A and second.reason == PREFIX and second.cached == 128
  assert router.routed[PREFIX] == 1
  assert send(router, "other", [A, B], conversation(1, seed=5)).group == B  # another conversation: the least loaded


def test_beyond_the_margin_the_least_loaded_group_wins():
  router = Router("a", Clock())
  send(router, "t1", [A, B], conversation(1))
  router.tokens("t1", [1], True)
  held = 64 // BLOCK * BLOCK  # the cached prefix: the whole first prompt
  for i in range(int((PREFIX_SLACK + held) // ROW_TOKENS) + 1):  # more running rows on the prefix group than the margin allows
    send(router, f"busy{i}", [A], prompt_tokens=1)
    router.tokens(f"busy{i}", [1], False)
  choice = send(router, "t2", [A, B], conversation(2))
  assert choice.group == B and choice.reason == LEAST_LOAD
  router.ended("t2")
  router.ended("busy0")  # within the margin again: the prefix wins
  assert router.load("a") > router.load("b")
  assert send(router, "t2b", [A, B], conversation(2)).reason == PREFIX


def test_a_short_shared_start_is_no_reason_to_pick_a_group():
  router = Router("a", Clock())
  send(router, "t1", [A, B], conversation(1))
  router.tokens("t1", [1], True)
  router.tokens("x", [1], False)
  long_other = conversation(1)[:BLOCK] + [9] * 200  # shares one block of 26: below the share that counts
  choice = send(router, "y", [A, B], long_other)
  assert choice.reason == LEAST_LOAD


def test_one_group_is_no_choice():
  router = Router("a", Clock())
  assert send(router, "r", [PIPE]).reason == ONLY_GROUP and router.load("c+d") == 64 + ROW_TOKENS


def test_a_route_from_a_peer_is_checked():
  route = Route((Stage("c", 0, 18), Stage("d", 19, 29)), "v1", "a")
  assert Route.of(dict(route.json), 30) == route and route.after("d") == route.first and route.group == "c+d"
  for bad in [{"v": "v1", "origin": "a", "hops": [["c", 0, 18]]}, {"v": "v1", "origin": "a", "hops": [["c", 0, 18], ["d", 20, 29]]},
              {"v": "v1", "origin": "a", "hops": [["c", 0, 18], ["c", 19, 29]]}, {"v": "", "origin": "a", "hops": [["c", 0, 29]]},
              {"v": "v1", "origin": "a", "hops": [["c", "0", 29]]}, ["c", 0, 29]]:
    with pytest.raises(InvalidRoute):
      Route.of(bad, 30)


def test_a_short_system_prompt_that_every_prompt_starts_with_does_not_pull_a_burst_onto_one_group():
  router = Router("a", Clock())
  system = list(range(3 * BLOCK))  # held by the group that served the first request
  send(router, "earlier", [A, B], system + [1] * 10)
  router.tokens("earlier", [2] * 8, True)
  picks = [send(router, f"r{i}", [A, B], system + [50 + i] * 12) for i in range(4)]
  assert {c.reason for c in picks} == {LEAST_LOAD} and {c.group.name for c in picks} == {"a", "b"}
  assert [c.cached for c in picks if c.group == A] == [3 * BLOCK] * 2  # rows spread evenly though a's prompts cost less


def test_a_steps_rows_for_one_hop_pack_into_one_message_and_unpack_as_they_were():
  import numpy as np

  from exo.orchestration.routing.packing import pack, unpack
  rows = [("r1", np.ones((1, 1, 4), np.float32), {"route": {"v": "x"}, "params": {"temperature": 0.0}}),
          ("r2", np.full((1, 3, 4), 2, np.float32), {"route": {"v": "y"}})]
  tensor, state = pack(rows)
  assert tensor.shape == (1, 4, 4) and state["route"] == {"v": "x"}
  back = unpack(tensor, state)
  assert [(rid, t.tolist(), s) for rid, t, s in back] == [(rid, t.tolist(), s) for rid, t, s in rows]
  for bad in [{"rows": []}, {"rows": [["r1", 2, {}]]}, {"rows": [["r1", 0, {}], ["r2", 4, {}]]}, {"rows": [["r1", "4", {}]]}, {"rows": [["", 4, {}]]}]:
    with pytest.raises(ValueError):
      unpack(tensor, bad)

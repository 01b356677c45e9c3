"""The opaque statuses' models (exo/orchestration/statuses.py): each kind our models build (`Model.build`) parses back to its typed
object, and a peer's status missing a field, with a field of the wrong type or past a bound is refused before
anything acts on it. The JSON we send is what old nodes of this fork read: field names and shapes fixed."""
import json

import pytest

from exo.inference.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs
from exo.inference.shard import Shard
from exo.orchestration import statuses

pytestmark = pytest.mark.unit

SHARD = Shard("m", 0, 3, 10)
FACTS = {"engine": "E", "float_bytes": 2, "memory_mb": 100, "speed": 1.5, "placement": "auto"}
REPO = {"commit": "c", "files": {"a": [1, "ab", None], "b": [2, None, "cd"]}, "verified": ["a"], "fetching": ["b"], "wants": True}

# kind -> (a good status as we build it, [(a change that must be refused, why), ...])
CASES = {
  statuses.NODE_STATUS: (json.dumps({"type": "node_status", "node_id": "a", "status": "start_process_prompt", "request_id": "r", "shard": SHARD.to_dict(),
                                     "prompt": "hi"}), [
    ({"node_id": None}, "missing"), ({"status": 3}, "type"), ({"request_id": "r" * 257}, "bound"), ({"shard": None}, "missing"),
    ({"shard": {**SHARD.to_dict(), "start_layer": 5, "end_layer": 4}}, "bound")]),
  statuses.DOWNLOAD_PROGRESS: (json.dumps({"type": "download_progress", "node_id": "a", "progress": {}, "sources": {"w": "hub"}}), [
    ({"progress": None}, "missing"), ({"progress": []}, "type"), ({"sources": {"w": 3}}, "type"),
    ({"sources": {f"f{i}": "hub" for i in range(statuses.MAX_REPO_FILES + 1)}}, "bound"), ({"sources": {"w": "x" * 1000}}, "bound")]),
  statuses.SUPPORTED_ENGINES: (json.dumps({"type": "supported_inference_engines", "node_id": "a", "engines": ["x"]}), [
    ({"engines": None}, "missing"), ({"engines": [1]}, "type"), ({"engines": ["x"] * (statuses.MAX_ENGINES + 1)}, "bound"), ({"engines": ["x" * 65]}, "bound")]),
  statuses.REQUEST_PARAMS: (statuses.RequestParams.build(request_id="r", params=SamplingParams(temperature=0.5, logit_bias=((1, 2.0),)), origin="o"), [
    ({"request_id": None}, "missing"), ({"params": None}, "missing"), ({"params": {"temperature": "hot"}}, "type"), ({"params": {"top_k": True}}, "type"),
    ({"params": {"temperature": 101}}, "bound"), ({"params": {"seed": 2**64}}, "bound"), ({"params": {"logprobs": MAX_TOP_LOGPROBS + 1}}, "bound"),
    ({"params": {"logit_bias": [[1, 101]]}}, "bound"), ({"params": {"grammar": ""}}, "bound"), ({"origin": ""}, "bound")]),
  statuses.CANCEL_REQUEST: (statuses.CancelRequest.build(request_id="r"), [({"request_id": None}, "missing"), ({"request_id": 5}, "type"), ({"request_id": "r" * 257}, "bound")]),
  statuses.REQUEST_ERROR: (statuses.RequestError.build(request_id="r", error="it broke"), [
    ({"error": None}, "missing"), ({"error": ["it broke"]}, "type"), ({"error": "e" * (10 * statuses.MAX_ERROR_CHARS + 1)}, "bound")]),
  statuses.STAGE_TIMING: (statuses.StageTiming.build(node_id="n", shard=SHARD, fixed_s=0.1, per_row_s=0.01, busy=0.5), [
    ({"shard": None}, "missing"), ({"fixed_s": "1"}, "type"), ({"busy": True}, "type"), ({"busy": 1.5}, "bound"), ({"per_row_s": float("inf")}, "bound")]),
  statuses.TOKEN_LOGPROBS: (statuses.TokenLogprobsStatus.build(request_id="r", position=3, logprob=-1.0, top=[(4, -1.0), (2, -2.0)]), [
    ({"position": None}, "missing"), ({"position": "3"}, "type"), ({"top": [[4]]}, "type"), ({"logprob": 0.1}, "bound"),
    ({"top": [[i, -1.0] for i in range(MAX_TOP_LOGPROBS + 1)]}, "bound")]),
  statuses.PREFIX_CACHE: (statuses.PrefixCache.build(node_id="n", block=16), [({"block": None}, "missing"), ({"block": 16.0}, "type"), ({"block": 4097}, "bound")]),
  statuses.PREFIX_MISS: (statuses.PrefixMiss.build(request_id="r", node_id="n"), [({"node_id": None}, "missing"), ({"node_id": ["n"]}, "type"), ({"node_id": ""}, "bound")]),
  statuses.PREFIX_EXTEND: (statuses.PrefixExtend.build(request_id="r", keys=["0" * 24]), [({"keys": None}, "missing"), ({"keys": "0" * 24}, "type"), ({"keys": ["x"]}, "bound")]),
  statuses.PLACEMENT_MEMBER: (statuses.PlacementMember.build(node_id="n", **FACTS, loaded=SHARD), [
    ({"engine": None}, "missing"), ({"memory_mb": "lots"}, "type"), ({"placement": "everywhere"}, "bound"), ({"float_bytes": 17}, "bound"),
    ({"loaded": {"model_id": "m"}}, "missing")]),
  statuses.GROUP_LOAD: (statuses.GroupLoad.build(node_id="n", group="g", loads={"a": [1, 2, 3]}), [
    ({"loads": None}, "missing"), ({"loads": {"a": [1, 2]}}, "type"), ({"loads": {"a": [1, -2, 3]}}, "bound"),
    ({"loads": {f"o{i}": [0, 0, 0] for i in range(statuses.MAX_ORIGINS + 1)}}, "bound")]),
  statuses.TOKENS: (statuses.Tokens.build(node_id="n", rows=[["r", [1], False, None], ["s", [2, 3], True, [-1.0, [[1, -1.0]]]]]), [
    ({"rows": None}, "missing"), ({"rows": []}, "bound"), ({"rows": [["r", [1], "no", None]]}, "type"), ({"rows": [["r", [1], False]]}, "missing"),
    ({"rows": [["r", list(range(65)), False, None]]}, "bound"), ({"rows": [["r", [1], False, [0.5, []]]]}, "bound"),
    ({"rows": [["r", [1], False, None]] * (statuses.MAX_ROWS + 1)}, "bound")]),
  statuses.STRUCTURED_OUTPUT: (statuses.StructuredOutput.build(node_id="n", engine="llguidance"), [({"engine": None}, "missing"), ({"engine": 1}, "type"), ({"engine": "e" * 65}, "bound")]),
  statuses.PEER_FILES: (statuses.PeerFiles.build(node_id="n", version=1, port=8080, offline=False, repos={"org/repo": REPO}), [
    ({"version": None}, "missing"), ({"offline": "no"}, "type"), ({"port": 0}, "bound"), ({"repos": {"r": {**REPO, "wants": None}}}, "type"),
    ({"repos": {"r": {k: v for k, v in REPO.items() if k != "commit"}}}, "missing"), ({"repos": {"r": {**REPO, "verified": ["elsewhere"]}}}, "bound"),
    ({"repos": {"r": {**REPO, "files": {"a": [1, "not hex!", None]}}}}, "type"), ({"repos": {f"r{i}": REPO for i in range(statuses.MAX_REPOS + 1)}}, "bound")]),
}


def _changed(good: str, change: dict) -> str:
  status = json.loads(good)
  for key, value in change.items():
    if value is None and key != "loaded":
      status.pop(key, None)
    elif key == "params":
      status["params"] = {**status["params"], **value}
    else:
      status[key] = value
  return json.dumps(status)


def test_every_kind_our_node_acts_on_has_its_cases():
  kinds = {v for k, v in vars(statuses).items() if k.isupper() and isinstance(v, str) and not k.startswith("MAX")}
  assert kinds == set(CASES)


@pytest.mark.parametrize("kind", list(CASES))
def test_a_status_we_send_parses_back_to_its_typed_object(kind):
  good, _ = CASES[kind]
  parsed_kind, status = statuses.parse(good)
  assert parsed_kind == kind and isinstance(status, statuses.Status) and status.type == kind and type(status) is not statuses.Unknown


@pytest.mark.parametrize("kind,change,why", [(kind, change, why) for kind, (_, changes) in CASES.items() for change, why in changes])
def test_a_status_missing_a_field_of_the_wrong_type_or_past_a_bound_is_refused(kind, change, why):
  with pytest.raises(statuses.InvalidStatus):
    statuses.parse(_changed(CASES[kind][0], change))


def test_the_typed_objects_hold_what_the_handlers_use():
  assert statuses.parse(CASES[statuses.REQUEST_PARAMS][0])[1].params == SamplingParams(temperature=0.5, logit_bias=((1, 2.0),))
  assert statuses.parse(CASES[statuses.STAGE_TIMING][0])[1].shard == SHARD
  assert statuses.parse(CASES[statuses.PLACEMENT_MEMBER][0])[1].loaded == SHARD
  assert statuses.parse(statuses.PlacementMember.build(node_id="n", **FACTS))[1].loaded is None
  assert statuses.parse(CASES[statuses.TOKEN_LOGPROBS][0])[1].logprobs == TokenLogprobs(-1.0, [(4, -1.0), (2, -2.0)])
  assert statuses.parse(CASES[statuses.GROUP_LOAD][0])[1].loads == {"a": (1, 2, 3)}
  rows = statuses.parse(CASES[statuses.TOKENS][0])[1].rows
  assert [(rid, tokens, finished) for rid, tokens, finished, _ in rows] == [("r", [1], False), ("s", [2, 3], True)] and rows[1][3] == (-1.0, [(1, -1.0)])
  repo = statuses.parse(CASES[statuses.PEER_FILES][0])[1].repos["org/repo"]
  assert (repo.commit, repo.files["a"], repo.verified, repo.fetching, repo.wants) == ("c", (1, "ab", None), ["a"], ["b"], True)
  node_status = statuses.parse(CASES[statuses.NODE_STATUS][0])[1]
  assert node_status.shard == SHARD and node_status.model_dump()["prompt"] == "hi"  # upstream's other keys stay, for the TUI


def test_our_statuses_travel_as_the_json_old_nodes_read():
  assert statuses.CancelRequest.build(request_id="r") == '{"type": "cancel_request", "request_id": "r"}'
  assert statuses.PrefixCache.build(node_id="n", block=16) == '{"type": "prefix_cache", "node_id": "n", "block": 16}'
  assert json.loads(statuses.PlacementMember.build(node_id="n", **FACTS, loaded=SHARD)) == {"type": "placement_member", "node_id": "n", **FACTS, "loaded": SHARD.to_dict()}
  assert json.loads(statuses.RequestParams.build(request_id="r", params=SamplingParams(), origin="o")) == {"type": "request_params", "request_id": "r", "params": json.loads(json.dumps(SamplingParams().to_dict())),
                                                                             "origin": "o"}
  assert json.loads(statuses.Tokens.build(node_id="n", rows=[["r", [1], False, None]])) == {"type": "tokens", "node_id": "n", "rows": [["r", [1], False, None]]}
  assert len(json.loads(statuses.RequestError.build(request_id="r", error="e" * 3 * statuses.MAX_ERROR_CHARS))["error"]) == statuses.MAX_ERROR_CHARS


def test_an_unknown_type_passes_through_and_what_is_not_a_json_object_is_refused():
  kind, status = statuses.parse('{"type": "from_the_future", "x": [1]}')
  assert kind == "from_the_future" and status.model_dump() == {"type": "from_the_future", "x": [1]}
  assert statuses.parse('{"x": 1}')[0] is None
  for raw, reason in (("nope", "not JSON"), ("[1]", "not a JSON object"), ('"node_status"', "not a JSON object")):
    with pytest.raises(statuses.InvalidStatus, match=reason):
      statuses.parse(raw)

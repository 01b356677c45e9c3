"""The opaque statuses nodes exchange (SendOpaqueStatus carries one JSON object; upstream nodes ignore types they do
not know): building ours, and checking every one a peer sends before anything acts on it."""
import json
import math
from typing import Any, List, Optional, Tuple

from exo.inference.grammar import MAX_GRAMMAR_CHARS
from exo.inference.prefix_cache import checked_keys
from exo.inference.penalties import MAX_LOGIT_BIAS, MAX_PENALTY_PROMPT, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from exo.inference.sampling import MAX_TOP_LOGPROBS, SamplingParams, TokenLogprobs
from exo.inference.shard import Shard

# Upstream's types
NODE_STATUS = "node_status"  # start_/end_process_prompt, with the request's shards
DOWNLOAD_PROGRESS = "download_progress"
SUPPORTED_ENGINES = "supported_inference_engines"
# This fork's types
REQUEST_PARAMS = "request_params"  # a request's sampling parameters and the node that asked, sent before its prompt
CANCEL_REQUEST = "cancel_request"  # its client has gone or has what it wanted: every node drops it
REQUEST_ERROR = "request_error"  # it failed somewhere: every node drops it, its client gets the error
REQUEST_ENDS = (CANCEL_REQUEST, REQUEST_ERROR)
STAGE_TIMING = "stage_timing"  # what a node's decode steps take for its layers, so the first node can size micro-batches
TOKEN_LOGPROBS = "token_logprobs"  # a sampled token's logprobs, sent to its origin just before the token's SendResult
PREFIX_CACHE = "prefix_cache"  # a node announces whether it reuses prompt prefixes: in blocks of `block` tokens, or 0 (not)
PREFIX_MISS = "prefix_miss"  # a node lacks the prefix a request was sent to reuse: its first node runs the prompt whole
PREFIX_EXTEND = "prefix_extend"  # a request finished: the block keys of all its cache holds (prompt and answer), to file
PLACEMENT_MEMBER = "placement_member"  # a node follows routes: the facts placement is derived from, and the layers it has loaded
GROUP_LOAD = "group_load"  # a group's first node: how much of its work (prompt tokens waiting, requests running and waiting) each origin sent
TOKENS = "tokens"  # the tokens one step sampled for the requests of one origin (and the last token of the others on their routes)
STRUCTURED_OUTPUT = "structured_output"  # a node announces that it samples requests' grammars (params.grammar), and with what
PEER_FILES = "peer_files"  # a node announces the model files it holds verified, those it wants and fetches, and its file server's port

MAX_ID_CHARS = 256
MAX_ERROR_CHARS = 2000
MAX_ENGINES = 16
MAX_ROWS = 4096  # rows of one tokens status
MAX_ORIGINS = 1024  # origins of one group_load status
MAX_REPOS = 256  # repositories of one peer_files status
MAX_REPO_FILES = 4096  # files of one repository in a peer_files status
MAX_PATH_CHARS = 1024


class InvalidStatus(ValueError):
  """A status that cannot be acted on; str(self) says why."""


def request_params(request_id: str, params: SamplingParams, origin: str) -> str:
  return json.dumps({"type": REQUEST_PARAMS, "request_id": request_id, "params": params.to_dict(), "origin": origin})


def cancel_request(request_id: str) -> str:
  return json.dumps({"type": CANCEL_REQUEST, "request_id": request_id})


def request_error(request_id: str, error: str) -> str:
  return json.dumps({"type": REQUEST_ERROR, "request_id": request_id, "error": error[:MAX_ERROR_CHARS]})


def stage_timing(node_id: str, shard: Shard, fixed_s: float, per_row_s: float, busy: float) -> str:
  return json.dumps({"type": STAGE_TIMING, "node_id": node_id, "shard": shard.to_dict(), "fixed_s": fixed_s, "per_row_s": per_row_s, "busy": busy})


def token_logprobs(request_id: str, position: int, logprobs: TokenLogprobs) -> str:
  return json.dumps({"type": TOKEN_LOGPROBS, "request_id": request_id, "position": position, "logprob": logprobs.logprob,
                     "top": [list(pair) for pair in logprobs.top]})


def logprobs_of(status: dict) -> TokenLogprobs:
  """The TokenLogprobs of a checked token_logprobs status."""
  return TokenLogprobs(float(status["logprob"]), [(int(t), float(lp)) for t, lp in status["top"]])


def prefix_cache(node_id: str, block: int) -> str:
  return json.dumps({"type": PREFIX_CACHE, "node_id": node_id, "block": block})


def prefix_miss(request_id: str, node_id: str) -> str:
  return json.dumps({"type": PREFIX_MISS, "request_id": request_id, "node_id": node_id})


def prefix_extend(request_id: str, keys: List[str]) -> str:
  return json.dumps({"type": PREFIX_EXTEND, "request_id": request_id, "keys": keys})


def placement_member(node_id: str, facts: dict, loaded: Optional[Shard]) -> str:
  return json.dumps({"type": PLACEMENT_MEMBER, "node_id": node_id, **facts, "loaded": loaded.to_dict() if loaded else None})


def group_load(node_id: str, group: str, loads: dict) -> str:
  return json.dumps({"type": GROUP_LOAD, "node_id": node_id, "group": group, "loads": loads})


def tokens(node_id: str, rows: List[list]) -> str:
  """rows: [request id, [token ids], finished, logprobs as [logprob, [[token, logprob], ...]] or None]"""
  return json.dumps({"type": TOKENS, "node_id": node_id, "rows": rows})


def structured_output(node_id: str, engine: str) -> str:
  return json.dumps({"type": STRUCTURED_OUTPUT, "node_id": node_id, "engine": engine})


def peer_files(node_id: str, version: int, port: int, offline: bool, repos: dict) -> str:
  """version: grows with each announcement of the node (one sent later may arrive earlier: the older is dropped);
  repos: repository -> {commit, files: {path: [size, sha256 or null, blob id or null]}, verified: [paths],
  fetching: [paths it fetches from the hub now], wants: whether it downloads the repository now}"""
  return json.dumps({"type": PEER_FILES, "node_id": node_id, "version": version, "port": port, "offline": offline, "repos": repos})


def parse(raw: str) -> Tuple[Optional[str], dict]:
  """(type, the status as a dict), checked for the types this node acts on; InvalidStatus if it cannot be used.
  (`shard` and `sampling_params` turn a checked status's parts into objects.)"""
  try:
    status = json.loads(raw)
  except (ValueError, RecursionError) as e:
    raise InvalidStatus(f"not JSON: {e}") from None
  if not isinstance(status, dict):
    raise InvalidStatus("not a JSON object")
  kind = status.get("type")
  check = _CHECKS.get(kind)
  if check is not None:
    check(status)
  return kind, status


def sampling_params(data: Any) -> SamplingParams:
  """A peer's sampling parameters, each checked: a bad value fails here, not inside a batch of other requests."""
  if not isinstance(data, dict):
    raise InvalidStatus("params must be an object")
  params = SamplingParams.from_dict(data)
  numbers = {"temperature": (0.0, 100.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0)}
  for name, (low, high) in numbers.items():
    value = getattr(params, name)
    if not _is_number(value) or not low <= value <= high:
      raise InvalidStatus(f"params.{name} must be a number in [{low}, {high}], got {value!r}")
  if not _is_int(params.top_k) or params.top_k < 0:
    raise InvalidStatus(f"params.top_k must be an integer >= 0, got {params.top_k!r}")
  if params.seed is not None and (not _is_int(params.seed) or not 0 <= params.seed < 2**64):
    raise InvalidStatus(f"params.seed must be an unsigned 64-bit integer, got {params.seed!r}")
  if params.max_tokens is not None and (not _is_int(params.max_tokens) or params.max_tokens < 1):
    raise InvalidStatus(f"params.max_tokens must be an integer >= 1, got {params.max_tokens!r}")
  for flag in ("ignore_eos", "bounded_numbers"):
    if not isinstance(getattr(params, flag), bool):
      raise InvalidStatus(f"params.{flag} must be true or false")
  if params.logprobs is not None and (not _is_int(params.logprobs) or not 0 <= params.logprobs <= MAX_TOP_LOGPROBS):
    raise InvalidStatus(f"params.logprobs must be null or an integer in [0, {MAX_TOP_LOGPROBS}], got {params.logprobs!r}")
  _check_processors(params)
  if params.grammar is not None and (not isinstance(params.grammar, str) or not params.grammar or len(params.grammar) > MAX_GRAMMAR_CHARS):
    raise InvalidStatus(f"params.grammar must be null or a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
  return params


def _check_processors(params: SamplingParams) -> None:
  """The logit processors' parameters (exo/inference/penalties.py), in the ranges the API allows."""
  for name, low, high in (("frequency_penalty", -2.0, 2.0), ("presence_penalty", -2.0, 2.0), ("repetition_penalty", MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)):
    value = getattr(params, name)
    if not _is_number(value) or not low <= value <= high:
      raise InvalidStatus(f"params.{name} must be a number in [{low}, {high}], got {value!r}")
  if params.penalty_window is not None and (not _is_int(params.penalty_window) or params.penalty_window < 0):
    raise InvalidStatus(f"params.penalty_window must be null or an integer >= 0, got {params.penalty_window!r}")
  if not _is_int(params.min_tokens) or params.min_tokens < 0:
    raise InvalidStatus(f"params.min_tokens must be an integer >= 0, got {params.min_tokens!r}")
  prompt = params.penalty_prompt
  if not isinstance(prompt, tuple) or len(prompt) > MAX_PENALTY_PROMPT or not all(_is_int(t) and 0 <= t < 2**31 for t in prompt):
    raise InvalidStatus(f"params.penalty_prompt must be a list of at most {MAX_PENALTY_PROMPT} token ids")
  bias = params.logit_bias
  if (not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS
      or not all(len(pair) == 2 and _is_int(pair[0]) and 0 <= pair[0] < 2**31 and _is_number(pair[1]) and -100 <= pair[1] <= 100 for pair in bias)):
    raise InvalidStatus(f"params.logit_bias must be a list of at most {MAX_LOGIT_BIAS} [token id, bias in [-100, 100]] pairs")


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _string(status: dict, key: str, optional: bool = False, limit: int = MAX_ID_CHARS) -> None:
  value = status.get(key)
  if value is None and optional:
    return
  if not isinstance(value, str) or not value or len(value) > limit:
    raise InvalidStatus(f"{key} must be a non-empty string of at most {limit} characters")


def _check_node_status(status: dict) -> None:
  _string(status, "node_id")
  _string(status, "status")
  _string(status, "request_id", optional=True)
  if status["status"] == "start_process_prompt":
    shard(status.get("shard"))


def shard(data: Any) -> Shard:
  if not isinstance(data, dict) or set(data) != {"model_id", "start_layer", "end_layer", "n_layers"}:
    raise InvalidStatus("shard must be an object with model_id, start_layer, end_layer and n_layers")
  layers = [data[k] for k in ("start_layer", "end_layer", "n_layers")]
  if not isinstance(data["model_id"], str) or not all(_is_int(v) for v in layers) or not 0 <= layers[0] <= layers[1] < layers[2]:
    raise InvalidStatus(f"shard is not a valid layer range: {data!r}"[:MAX_ID_CHARS])
  return Shard(**data)


def _check_download_progress(status: dict) -> None:
  _string(status, "node_id")
  if not isinstance(status.get("progress"), dict):
    raise InvalidStatus("progress must be an object")
  sources = status.get("sources", {})  # this fork's: where each file arriving now comes from ("hub" or "peer <id>")
  if (not isinstance(sources, dict) or len(sources) > MAX_REPO_FILES
      or not all(isinstance(p, str) and len(p) <= MAX_PATH_CHARS and isinstance(s, str) and len(s) <= MAX_ID_CHARS + 5 for p, s in sources.items())):
    raise InvalidStatus(f"sources must map at most {MAX_REPO_FILES} files to where they come from")


def _check_engines(status: dict) -> None:
  _string(status, "node_id")
  engines = status.get("engines")
  if not isinstance(engines, list) or len(engines) > MAX_ENGINES or not all(isinstance(e, str) and len(e) <= 64 for e in engines):
    raise InvalidStatus(f"engines must be a list of at most {MAX_ENGINES} names")


def _check_request_params(status: dict) -> None:
  _string(status, "request_id")
  _string(status, "origin", optional=True)
  sampling_params(status.get("params"))


def _check_request_end(status: dict) -> None:
  _string(status, "request_id")
  if status["type"] == REQUEST_ERROR:
    _string(status, "error", limit=10 * MAX_ERROR_CHARS)


def _check_stage_timing(status: dict) -> None:
  _string(status, "node_id")
  shard(status.get("shard"))
  for key, high in (("fixed_s", 3600.0), ("per_row_s", 3600.0), ("busy", 1.0)):
    if not _is_number(status.get(key)) or not 0 <= status[key] <= high:
      raise InvalidStatus(f"{key} must be a number in [0, {high:g}]")


def _logprob(value: Any) -> bool:
  return _is_number(value) and value <= 0


def _check_token_logprobs(status: dict) -> None:
  _string(status, "request_id")
  position, top = status.get("position"), status.get("top")
  if not _is_int(position) or position < 0:
    raise InvalidStatus("position must be an integer >= 0")
  if not _logprob(status.get("logprob")):
    raise InvalidStatus("logprob must be a number <= 0")
  if (not isinstance(top, list) or len(top) > MAX_TOP_LOGPROBS
      or not all(isinstance(p, list) and len(p) == 2 and _is_int(p[0]) and p[0] >= 0 and _logprob(p[1]) for p in top)):
    raise InvalidStatus(f"top must be a list of at most {MAX_TOP_LOGPROBS} [token id, logprob <= 0] pairs")


def _check_prefix_cache(status: dict) -> None:
  _string(status, "node_id")
  if not _is_int(status.get("block")) or not 0 <= status["block"] <= 4096:
    raise InvalidStatus("block must be an integer from 0 to 4096")


def _check_prefix_miss(status: dict) -> None:
  _string(status, "request_id")
  _string(status, "node_id")


def _check_structured_output(status: dict) -> None:
  _string(status, "node_id")
  _string(status, "engine", limit=64)


def _check_prefix_extend(status: dict) -> None:
  _string(status, "request_id")
  try:
    checked_keys(status.get("keys"), "keys")
  except ValueError as e:
    raise InvalidStatus(str(e)) from None


def _check_placement_member(status: dict) -> None:
  _string(status, "node_id")
  _string(status, "engine")
  if status.get("placement") not in ("auto", "pipeline", "replicas"):
    raise InvalidStatus("placement must be auto, pipeline or replicas")
  for key, high in (("float_bytes", 16), ("memory_mb", 1 << 40), ("speed", 1e9)):
    if not _is_number(status.get(key)) or not 0 <= status[key] <= high:
      raise InvalidStatus(f"{key} must be a number in [0, {high:g}]")
  if status.get("loaded") is not None:
    shard(status["loaded"])


def _check_group_load(status: dict) -> None:
  _string(status, "node_id")
  _string(status, "group", limit=64 * MAX_ID_CHARS)
  loads = status.get("loads")
  if (not isinstance(loads, dict) or len(loads) > MAX_ORIGINS
      or not all(isinstance(o, str) and isinstance(v, list) and len(v) == 3 and all(_is_int(x) and x >= 0 for x in v) for o, v in loads.items())):
    raise InvalidStatus(f"loads must map at most {MAX_ORIGINS} origins to [prompt tokens waiting, requests running, requests waiting]")


def _check_tokens(status: dict) -> None:
  _string(status, "node_id")
  rows = status.get("rows")
  if not isinstance(rows, list) or not 1 <= len(rows) <= MAX_ROWS:
    raise InvalidStatus(f"rows must list 1 to {MAX_ROWS} rows")
  for row in rows:
    if (not isinstance(row, list) or len(row) != 4 or not isinstance(row[0], str) or not row[0] or len(row[0]) > MAX_ID_CHARS
        or not isinstance(row[1], list) or not 1 <= len(row[1]) <= 64 or not all(_is_int(t) and t >= 0 for t in row[1])
        or not isinstance(row[2], bool)):
      raise InvalidStatus("each row must be [request id, [token ids], finished, logprobs or null]")
    if row[3] is not None:
      _check_token_logprobs({"request_id": row[0], "position": 0, "logprob": row[3][0] if isinstance(row[3], list) and row[3] else None,
                             "top": row[3][1] if isinstance(row[3], list) and len(row[3]) == 2 else None})


def _hex(value: Any) -> bool:
  return value is None or (isinstance(value, str) and 0 < len(value) <= 128 and all(c in "0123456789abcdefABCDEF" for c in value))


def _path_list(value: Any, files: dict, key: str) -> None:
  if not isinstance(value, list) or len(value) > MAX_REPO_FILES or not all(isinstance(p, str) and p in files for p in value):
    raise InvalidStatus(f"{key} must list at most {MAX_REPO_FILES} of the repository's files")


def _check_peer_files(status: dict) -> None:
  _string(status, "node_id")
  if not _is_int(status.get("version")) or status["version"] < 0:
    raise InvalidStatus("version must be an integer >= 0")
  if not _is_int(status.get("port")) or not 1 <= status["port"] <= 65535:
    raise InvalidStatus("port must be an integer from 1 to 65535")
  if not isinstance(status.get("offline"), bool):
    raise InvalidStatus("offline must be true or false")
  repos = status.get("repos")
  if not isinstance(repos, dict) or len(repos) > MAX_REPOS:
    raise InvalidStatus(f"repos must map at most {MAX_REPOS} repositories to what is held of them")
  for repo_id, repo in repos.items():
    if not isinstance(repo_id, str) or not 0 < len(repo_id) <= MAX_ID_CHARS or not isinstance(repo, dict):
      raise InvalidStatus("each repository must be named and described by an object")
    _string(repo, "commit", limit=128)
    files = repo.get("files")
    if (not isinstance(files, dict) or len(files) > MAX_REPO_FILES
        or not all(isinstance(p, str) and 0 < len(p) <= MAX_PATH_CHARS and isinstance(f, list) and len(f) == 3 and _is_int(f[0]) and f[0] >= 0
                   and _hex(f[1]) and _hex(f[2]) for p, f in files.items())):
      raise InvalidStatus(f"files of {repo_id[:MAX_ID_CHARS]} must map at most {MAX_REPO_FILES} paths to [size, sha256, blob id]")
    _path_list(repo.get("verified"), files, "verified")
    _path_list(repo.get("fetching"), files, "fetching")
    if not isinstance(repo.get("wants"), bool):
      raise InvalidStatus("wants must be true or false")


_CHECKS = {
  NODE_STATUS: _check_node_status, DOWNLOAD_PROGRESS: _check_download_progress, SUPPORTED_ENGINES: _check_engines,
  REQUEST_PARAMS: _check_request_params, CANCEL_REQUEST: _check_request_end, REQUEST_ERROR: _check_request_end,
  STAGE_TIMING: _check_stage_timing,
  TOKEN_LOGPROBS: _check_token_logprobs,
  PREFIX_CACHE: _check_prefix_cache, PREFIX_MISS: _check_prefix_miss, PREFIX_EXTEND: _check_prefix_extend,
  PLACEMENT_MEMBER: _check_placement_member, GROUP_LOAD: _check_group_load, TOKENS: _check_tokens,
  STRUCTURED_OUTPUT: _check_structured_output, PEER_FILES: _check_peer_files,
}

"""The opaque statuses nodes exchange (SendOpaqueStatus carries one JSON object; upstream nodes ignore types they do
not know): one pydantic model per type this node acts on, which builds ours and checks every one a peer sends
before anything acts on it. `parse` gives the typed status; a type this node does not know passes through as
`Unknown`."""
import json
from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, PlainSerializer, PlainValidator, StrictBool, StrictFloat, StrictInt, StrictStr,
                      StringConstraints, Tag, TypeAdapter, ValidationError, model_validator)

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


def _text(limit: int = MAX_ID_CHARS, min_length: int = 1):
  return Annotated[StrictStr, StringConstraints(min_length=min_length, max_length=limit)]


def _number(low: float, high: float):
  """A finite JSON number (never a boolean) in [low, high]."""
  return Annotated[StrictFloat, Field(ge=low, le=high, allow_inf_nan=False)]


def _int(low: int, high: Optional[int] = None):
  return Annotated[StrictInt, Field(ge=low, le=high)]


Id = _text()
LogProb = Annotated[StrictFloat, Field(le=0, allow_inf_nan=False)]
TokenId = _int(0)
Top = Annotated[List[Tuple[TokenId, LogProb]], Field(max_length=MAX_TOP_LOGPROBS)]  # [[token id, logprob], ...]
Hex = Annotated[StrictStr, StringConstraints(min_length=1, max_length=128, pattern=r"^[0-9a-fA-F]+$")]


def shard(data: Any) -> Shard:
  if not isinstance(data, dict) or set(data) != {"model_id", "start_layer", "end_layer", "n_layers"}:
    raise InvalidStatus("shard must be an object with model_id, start_layer, end_layer and n_layers")
  layers = [data[k] for k in ("start_layer", "end_layer", "n_layers")]
  if (not isinstance(data["model_id"], str) or not all(isinstance(v, int) and not isinstance(v, bool) for v in layers)
      or not 0 <= layers[0] <= layers[1] < layers[2]):
    raise InvalidStatus(f"shard is not a valid layer range: {data!r}"[:MAX_ID_CHARS])
  return Shard(**data)


class _ParamBounds(BaseModel):
  """The ranges the API allows for a request's sampling parameters (and its logit processors', exo/inference/penalties.py)."""
  model_config = ConfigDict(extra="ignore")
  temperature: _number(0.0, 100.0)
  top_p: _number(0.0, 1.0)
  min_p: _number(0.0, 1.0)
  top_k: _int(0)
  seed: Optional[_int(0, 2**64 - 1)]
  max_tokens: Optional[_int(1)]
  ignore_eos: StrictBool
  bounded_numbers: StrictBool
  logprobs: Optional[_int(0, MAX_TOP_LOGPROBS)]
  grammar: Optional[_text(MAX_GRAMMAR_CHARS)]
  frequency_penalty: _number(-2.0, 2.0)
  presence_penalty: _number(-2.0, 2.0)
  repetition_penalty: _number(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
  penalty_window: Optional[_int(0)]
  min_tokens: _int(0)
  penalty_prompt: Annotated[Tuple[_int(0, 2**31 - 1), ...], Field(max_length=MAX_PENALTY_PROMPT)]
  logit_bias: Annotated[Tuple[Tuple[_int(0, 2**31 - 1), _number(-100, 100)], ...], Field(max_length=MAX_LOGIT_BIAS)]


def sampling_params(data: Any) -> SamplingParams:
  """A peer's sampling parameters, each checked: a bad value fails here, not inside a batch of other requests."""
  if not isinstance(data, dict):
    raise InvalidStatus("params must be an object")
  params = SamplingParams.from_dict(data)
  try:
    _ParamBounds.model_validate(vars(params))
  except ValidationError as e:
    raise InvalidStatus(_reason(e, "params.")) from None
  return params


ShardField = Annotated[Shard, PlainValidator(shard), PlainSerializer(Shard.to_dict)]
ParamsField = Annotated[SamplingParams, PlainValidator(sampling_params), PlainSerializer(SamplingParams.to_dict)]


class Status(BaseModel):
  """A status of a known type: extra keys are ignored (upstream's types keep them, for observers that show them)."""
  model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

  def encode(self) -> str:
    """The JSON the status travels as: its fields in order, `type` first."""
    return json.dumps({name: value for name, value in self}, default=lambda value: value.to_dict())

  @classmethod
  def build(cls, **fields) -> str:
    """Our own status, as is (what we send is what we made; peers check it as they check every status)."""
    return cls.model_construct(**fields).encode()


class Unknown(Status):
  """A type this node does not act on (or none): passed through unchecked."""
  model_config = ConfigDict(extra="allow")
  type: Any = None


class NodeStatus(Status):
  model_config = ConfigDict(extra="allow")
  type: Literal[NODE_STATUS] = NODE_STATUS
  node_id: Id
  status: Id
  request_id: Optional[Id] = None
  shard: Optional[ShardField] = None  # start_process_prompt's: the layers to preload (checked for that status only)

  @model_validator(mode="before")
  @classmethod
  def _shard_of_start_only(cls, data: Any) -> Any:
    if isinstance(data, dict) and data.get("status") != "start_process_prompt":
      return {k: v for k, v in data.items() if k != "shard"}
    if isinstance(data, dict) and data.get("shard") is None:
      raise InvalidStatus("shard must be an object with model_id, start_layer, end_layer and n_layers")
    return data


class DownloadProgress(Status):
  model_config = ConfigDict(extra="allow")
  type: Literal[DOWNLOAD_PROGRESS] = DOWNLOAD_PROGRESS
  node_id: Id
  progress: Dict[str, Any]
  # this fork's: where each file arriving now comes from ("hub" or "peer <id>")
  sources: Annotated[Dict[_text(MAX_PATH_CHARS, 0), _text(MAX_ID_CHARS + 5, 0)], Field(max_length=MAX_REPO_FILES)] = {}


class SupportedEngines(Status):
  type: Literal[SUPPORTED_ENGINES] = SUPPORTED_ENGINES
  node_id: Id
  engines: Annotated[List[_text(64, 0)], Field(max_length=MAX_ENGINES)]


class RequestParams(Status):
  type: Literal[REQUEST_PARAMS] = REQUEST_PARAMS
  request_id: Id
  params: ParamsField
  origin: Optional[Id] = None


class CancelRequest(Status):
  type: Literal[CANCEL_REQUEST] = CANCEL_REQUEST
  request_id: Id


class RequestError(Status):
  type: Literal[REQUEST_ERROR] = REQUEST_ERROR
  request_id: Id
  error: _text(10 * MAX_ERROR_CHARS)

  @classmethod
  def build(cls, request_id: str, error: str) -> str:
    return super().build(request_id=request_id, error=error[:MAX_ERROR_CHARS])  # ours are shorter than a peer's may be


class StageTiming(Status):
  type: Literal[STAGE_TIMING] = STAGE_TIMING
  node_id: Id
  shard: ShardField
  fixed_s: _number(0, 3600.0)
  per_row_s: _number(0, 3600.0)
  busy: _number(0, 1.0)


class TokenLogprobsStatus(Status):
  type: Literal[TOKEN_LOGPROBS] = TOKEN_LOGPROBS
  request_id: Id
  position: _int(0)
  logprob: LogProb
  top: Top

  @property
  def logprobs(self) -> TokenLogprobs:
    return TokenLogprobs(float(self.logprob), [(t, float(lp)) for t, lp in self.top])


class PrefixCache(Status):
  type: Literal[PREFIX_CACHE] = PREFIX_CACHE
  node_id: Id
  block: _int(0, 4096)


class PrefixMiss(Status):
  type: Literal[PREFIX_MISS] = PREFIX_MISS
  request_id: Id
  node_id: Id


class PrefixExtend(Status):
  type: Literal[PREFIX_EXTEND] = PREFIX_EXTEND
  request_id: Id
  keys: Annotated[List[str], PlainValidator(lambda keys: checked_keys(keys, "keys"))]


class PlacementMember(Status):
  type: Literal[PLACEMENT_MEMBER] = PLACEMENT_MEMBER
  node_id: Id
  engine: Id
  float_bytes: _number(0, 16)
  memory_mb: _number(0, 1 << 40)
  speed: _number(0, 1e9)
  placement: Literal["auto", "pipeline", "replicas"]
  loaded: Optional[ShardField] = None


class GroupLoad(Status):
  type: Literal[GROUP_LOAD] = GROUP_LOAD
  node_id: Id
  group: _text(64 * MAX_ID_CHARS)
  # origin -> (prompt tokens waiting, requests running, requests waiting)
  loads: Annotated[Dict[StrictStr, Tuple[_int(0), _int(0), _int(0)]], Field(max_length=MAX_ORIGINS)]


# (request id, its token ids, finished, its last token's logprobs as (logprob, [(token, logprob), ...]) or None)
TokenRow = Tuple[Id, Annotated[List[TokenId], Field(min_length=1, max_length=64)], StrictBool, Optional[Tuple[LogProb, Top]]]


class Tokens(Status):
  type: Literal[TOKENS] = TOKENS
  node_id: Id
  rows: Annotated[List[TokenRow], Field(min_length=1, max_length=MAX_ROWS)]


class StructuredOutput(Status):
  type: Literal[STRUCTURED_OUTPUT] = STRUCTURED_OUTPUT
  node_id: Id
  engine: _text(64)


FileEntry = Tuple[_int(0), Optional[Hex], Optional[Hex]]  # (size, sha256 or None, blob id or None)
PathList = Annotated[List[StrictStr], Field(max_length=MAX_REPO_FILES)]


class RepoHoldings(BaseModel):
  """What a node holds of one repository."""
  commit: _text(128)
  files: Annotated[Dict[_text(MAX_PATH_CHARS), FileEntry], Field(max_length=MAX_REPO_FILES)]
  verified: PathList
  fetching: PathList  # those it fetches from the hub now
  wants: StrictBool  # whether it downloads the repository now

  @model_validator(mode="after")
  def _paths_are_its_files(self) -> "RepoHoldings":
    if not all(p in self.files for p in (*self.verified, *self.fetching)):
      raise ValueError(f"verified and fetching must list at most {MAX_REPO_FILES} of the repository's files")
    return self


class PeerFiles(Status):
  type: Literal[PEER_FILES] = PEER_FILES
  node_id: Id
  version: _int(0)  # grows with each announcement of the node (one sent later may arrive earlier: the older is dropped)
  port: _int(1, 65535)
  offline: StrictBool
  repos: Annotated[Dict[Id, RepoHoldings], Field(max_length=MAX_REPOS)]


_KINDS = {model.model_fields["type"].default: model for model in Status.__subclasses__() if model is not Unknown}  # every type above


def _kind_of(data: Any) -> str:
  kind = data.get("type") if isinstance(data, dict) else getattr(data, "type", None)
  return kind if isinstance(kind, str) and kind in _KINDS else "unknown"


_ANY_STATUS = TypeAdapter(Annotated[Union[tuple(Annotated[model, Tag(kind)] for kind, model in _KINDS.items()) + (Annotated[Unknown, Tag("unknown")],)],
                                    Discriminator(_kind_of)])


def _reason(error: ValidationError, prefix: str = "", skip: int = 0) -> str:
  first = error.errors(include_url=False)[0]
  where = ".".join(str(part) for part in first["loc"][skip:])
  return f"{prefix}{where}: {first['msg']}" if where else first["msg"]


def parse(raw: str) -> Tuple[Optional[str], Status]:
  """(type, the typed status), checked for the types this node acts on; InvalidStatus if it cannot be used."""
  try:
    status = _ANY_STATUS.validate_json(raw)
  except ValidationError as e:
    first = e.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
      raise InvalidStatus(f"not JSON: {first['msg']}") from None
    if first["type"] == "model_type" and len(first["loc"]) == 1:
      raise InvalidStatus("not a JSON object") from None
    raise InvalidStatus(_reason(e, skip=1)) from None
  return status.type, status


"""What every dialect's requests share: the body read as JSON, the model resolved, and the fields of the body
models (exo/api/body_model.py) that several dialects take: the sampling parameters, the reply's token budget, stop
strings, OpenAI's common fields."""
import json
import re
from dataclasses import fields
from typing import Annotated, Any, Dict, Iterable, List, Optional, Tuple, Union

from pydantic import AfterValidator, BaseModel, Field, PlainValidator, model_validator

from exo.api.body_model import MAX_INT32, Body, Closed, Flag, Text, checked, integer, invalid, number
from exo.api.errors import BadRequest
from exo.inference.penalties import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from exo.inference.sampling import MAX_TOP_LOGPROBS, SamplingParams
from exo.local_checkpoints import model_card, ollama_name
from exo.models import get_repo, model_cards

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_JSON_DEPTH = 64  # far beyond any real request; deeper bodies would exhaust recursion in templating
MAX_CHOICES = 16  # n (times the prompts, on /v1/completions): each choice is a request of its own
# A JSON string escape that may decode to half of a surrogate pair (only escapes can: the body is strict UTF-8).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def parse_json_body(raw: bytes) -> Dict[str, Any]:
  """A request body as a JSON object: strict UTF-8, no lone surrogates, nesting at most MAX_JSON_DEPTH deep."""
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise BadRequest(f"the request body is not valid UTF-8 ({e.reason} at byte {e.start})", code="invalid_encoding") from None
  try:
    body = json.loads(text)
  except RecursionError:
    raise BadRequest(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", code="invalid_json") from None
  except ValueError as e:
    raise BadRequest(f"Invalid JSON body: {e}", code="invalid_json") from None
  if not isinstance(body, dict):
    raise BadRequest("Request body must be a JSON object", code="invalid_json")
  _check_tree(body, check_strings=SURROGATE_ESCAPE.search(text) is not None)
  return body


def _check_tree(body: dict, check_strings: bool) -> None:
  """Walks the body without recursion: depth, and strings that cannot be encoded (lone surrogates)."""
  stack = [(body, "", 1)]
  while stack:
    value, path, depth = stack.pop()
    if depth > MAX_JSON_DEPTH:
      raise BadRequest(f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", param=path or None, code="invalid_json")
    if isinstance(value, dict):
      for key, item in value.items():
        if check_strings:
          _check_string(key, path or "body")
        stack.append((item, f"{path}.{key}" if path else key, depth + 1))
    elif isinstance(value, list):
      stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))
    elif check_strings and isinstance(value, str):
      _check_string(value, path)


def _check_string(value: str, path: str) -> None:
  try:
    value.encode("utf-8")
  except UnicodeEncodeError as e:
    raise BadRequest(f"{path} contains a lone surrogate ({value[e.start]!r} at character {e.start}), which is not text", param=path,
                     code="invalid_encoding") from None


def supported_models(engine_classname: str) -> List[str]:
  return [m for m in model_cards if get_repo(m, engine_classname) is not None]


def resolve_model(requested: Any, default_model: str, engine_classname: str, fallback_prefixes: Iterable[str] = ("gpt-",)) -> str:
  """The registry id (or served local checkpoint path, see exo/local_checkpoints.py) a request runs on.

  Upstream's fallbacks are kept: an omitted, null or empty `model`, and any name with a fallback prefix (OpenAI
  clients send `gpt-*` names by habit, Anthropic's `claude-*`), mean the default model. Unlike upstream, a name that
  is neither a registry id nor such a fallback is rejected (400, listing the supported models) instead of silently
  answering from the default model: a typo in a model name should not get an answer from a different model. A
  registry id that this node's engine cannot run is a 400 with the same message, as upstream."""
  if requested is not None and not isinstance(requested, str):
    raise BadRequest("model must be a string", param="model")
  model = default_model if not requested or requested.startswith(tuple(fallback_prefixes)) else ollama_name(requested)
  try:
    model_card(model)  # a local checkpoint's path joins the registry here, if this node serves it
  except ValueError as e:
    raise BadRequest(str(e)) from None
  if get_repo(model, engine_classname) is None:
    raise BadRequest(f"Unsupported model: {model} with inference engine {engine_classname}. "
                     f"Supported models for this engine: {supported_models(engine_classname)}", param="model", code="model_not_found")
  return model


def is_number(value: Any) -> bool:
  # Compared, not converted: math.isfinite(10**400) raises, a comparison of any int with a float does not.
  return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def stop_strings(limit: int = MAX_STOP_STRINGS) -> Any:
  """Stop strings: one, or a list of at most `limit`; a list once read."""
  text = Annotated[str, Field(strict=True, min_length=1)]
  return Annotated[checked(Union[text, Annotated[List[text], Field(max_length=limit)]],
                           f"must be a non-empty string or a list of at most {limit} non-empty strings"),
                   AfterValidator(lambda value: [value] if isinstance(value, str) else value or [])]


def _logit_bias(value: Any) -> Tuple[Tuple[int, float], ...]:
  """OpenAI's map of token ids (as strings, JSON's keys) to a bias between -100 and 100."""
  if value is None:
    return ()
  if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
    raise invalid(f'must be an object mapping token ids to a bias, such as {{"1734": -100}} (at most {MAX_LOGIT_BIAS} tokens)')
  for key, bias in value.items():
    if not re.fullmatch(r"[0-9]{1,10}", str(key)) or int(key) > MAX_INT32:
      raise invalid(f"keys must be token ids (integers >= 0), got {key!r}")
    if not is_number(bias) or not -100 <= bias <= 100:
      raise invalid(f"[{key!r}] must be a number between -100 and 100 (-100 bans the token)", at=f".{key}", said=f".{key}")
  return tuple(sorted((int(key), float(bias)) for key, bias in value.items()))


MaxTokens = integer(1, f"must be an integer >= 1 (and at most {MAX_INT32})")
TopK = integer(0, f"must be an integer >= 0 (0 means no limit; at most {MAX_INT32})")
Seed = checked(Annotated[int, Field(strict=True, ge=-2**63, lt=2**64)], "must be an integer (64-bit)")
Penalty = number(-2.0, 2.0)
RepetitionPenalty = number(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                           f"must be a number between {MIN_REPETITION_PENALTY:g} and {MAX_REPETITION_PENALTY:g} (1 means none)")
LogprobCount = integer(0, f"must be an integer between 0 and {MAX_TOP_LOGPROBS}", MAX_TOP_LOGPROBS)
LogitBias = Annotated[Tuple[Tuple[int, float], ...], PlainValidator(_logit_bias)]
MinTokens = integer(0, "must be an integer >= 0 and at most the token budget")
SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


def sampling_params(body: BaseModel, default_temperature: float, **values: Any) -> SamplingParams:
  """SamplingParams from the body's fields of the same names (a field left out or null keeps its default), with
  `values` for those a dialect names otherwise; the temperature not given is the server's default."""
  given = {name: getattr(body, name) for name in SAMPLING_FIELDS & set(type(body).model_fields)}
  given = {name: value for name, value in {**given, **values}.items() if value is not None}
  if given.get("seed") is not None:
    given["seed"] %= 2**64  # OpenAI allows negative seeds; the generator wants an unsigned one
  return SamplingParams(**{"temperature": default_temperature, **given})


class Sampling(Body):
  """The sampling fields OpenAI's routes and Ollama's options share, under the names OpenAI and vLLM give them."""
  temperature: number(0.0, 2.0) = None
  top_p: number(0.0, 1.0) = None
  top_k: TopK = None
  min_p: number(0.0, 1.0) = None
  seed: Seed = None
  frequency_penalty: Penalty = None
  presence_penalty: Penalty = None


class StreamOptions(Closed):
  include_usage: Flag = None


class OpenAIBody(Sampling):
  """The fields OpenAI's chat and text completions share."""
  model: Any = None
  stream: Flag = None
  stream_options: checked(StreamOptions, 'must be an object like {"include_usage": true}') = None
  max_tokens: MaxTokens = None
  ignore_eos: Flag = None
  repetition_penalty: RepetitionPenalty = None
  logit_bias: LogitBias = None
  min_tokens: MinTokens = None
  stop: stop_strings() = None
  n: integer(1, f"must be an integer between 1 and {MAX_CHOICES}", MAX_CHOICES) = None
  user: Text = None

  def budget(self) -> Optional[int]:
    """The reply's token budget, where the request sets one."""
    return self.max_tokens

  @model_validator(mode="after")
  def _min_within_budget(self):  # (a fault of two fields together: the 400 itself, naming the one to change)
    if self.min_tokens is not None and self.budget() is not None and self.min_tokens > self.budget():
      raise BadRequest("min_tokens must be an integer >= 0 and at most the token budget", param="min_tokens")
    return self

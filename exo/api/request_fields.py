"""What every dialect's requests share: the body read as JSON, the model resolved, and the pydantic types each
dialect's body model (`Body`) declares its fields with: numbers in their ranges, sampling parameters, stop strings,
flags. A body that breaks them is a BadRequest naming the field (`options.top_k` for a field inside an object) and
saying why; a field a dialect does not implement is refused the same way, never silently ignored."""
import json
import re
from dataclasses import fields
from typing import Annotated, Any, Dict, Iterable, List, Optional, Tuple, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Discriminator, Field, PlainValidator, Tag, ValidationError, WrapValidator,
                      model_validator)
from pydantic_core import PydanticCustomError

from exo.api.errors import BadRequest
from exo.inference.penalties import MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY
from exo.inference.sampling import MAX_TOP_LOGPROBS, SamplingParams
from exo.local_checkpoints import model_card, ollama_name
from exo.models import get_repo, model_cards

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_JSON_DEPTH = 64  # far beyond any real request; deeper bodies would exhaust recursion in templating
MAX_INT32 = 2**31 - 1
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


# --- body models: each field's type says what it takes (null always means its default) ---

def invalid(why: str, code: Optional[str] = None, at: str = "", said: str = "") -> PydanticCustomError:
  """A field's fault, raised inside a validator: `why` follows the field's name in the message; `at` names the part
  of the field at fault (`.messages` in chat_template_kwargs), less the tail of it that `why` has `said` in its own
  words; `code` is the error's code."""
  return PydanticCustomError(code or "invalid", why, {"at": at, "said": said})


def _path(loc: Iterable[Any]) -> str:
  """A location as a suffix of a field's name: `.content[0]` (a `tagged` object's <tag> is no part of it)."""
  return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc if not (str(p).startswith("<") and str(p).endswith(">")))


def _own(error: ValidationError, extra: bool) -> Optional[dict]:
  """The first fault raised by `invalid` (a field's own message), or (`extra`) naming a field not taken, if any."""
  return next((e for e in error.errors(include_url=False) if (extra and e["type"] == "extra_forbidden") or "at" in (e.get("ctx") or {})), None)


def bad_request(error: ValidationError) -> BadRequest:
  """The 400 for a body's first fault; a field this server does not know, then one it does not implement, is named
  before any other (as a client most needs to hear that its request asks for what it will not get)."""
  errors = error.errors(include_url=False)
  first = min(errors, key=lambda e: {"extra_forbidden": 0, "unsupported_parameter": 1}.get(e["type"], 2))  # (the first of its kind)
  where, ctx = _path(first["loc"]).lstrip("."), first.get("ctx") or {}
  param = (where + ctx.get("at", "")).lstrip(".")
  if first["type"] == "extra_forbidden":
    return BadRequest(f"Unrecognized request argument supplied: {param}", param=param, code="unsupported_parameter")
  why = first["msg"] if "at" in ctx else f"is not valid: {first['msg']}"  # (pydantic's own words: a fault no type below explains)
  named = param[:len(param) - len(ctx.get("said", ""))]
  message = f"{named}{'' if why[:1] in ':[' else ' '}{why}" if named else why
  return BadRequest(message, param=param or None, code=first["type"] if "at" in ctx and first["type"] != "invalid" else None)


class Body(BaseModel):
  """A request body: the fields a dialect takes, each typed below (null means its default); any other is refused."""
  model_config = ConfigDict(extra="forbid", validate_default=True, arbitrary_types_allowed=True)

  @classmethod
  def read(cls, body: Any):
    try:
      return cls.model_validate(body)
    except ValidationError as e:
      raise bad_request(e) from None


class Closed(BaseModel):
  """An object's fields, where another key makes the whole object invalid (the object, not the key, is named)."""
  model_config = ConfigDict(extra="forbid", validate_default=True)


def checked(kind: Any, why: str, code: Optional[str] = None, optional: bool = True) -> Any:
  """A field of type `kind` (with its constraints), or null when `optional`; anything else fails saying `why`."""
  def explain(value: Any, handler):
    if value is None and optional:
      return None
    try:
      return handler(value)
    except ValidationError as e:
      own = _own(e, isinstance(kind, type) and issubclass(kind, Body))  # a part's own fault, said of that part; any other is the field's
      if own is None:
        raise invalid(why, code) from None
      ctx = own.get("ctx") or {}
      own_code = None if own["type"] == "invalid" else own["type"]
      raise invalid(own["msg"], own_code, _path(own["loc"]) + ctx.get("at", ""), ctx.get("said", "")) from None
  return Annotated[kind, WrapValidator(explain)]  # (null never reaches `kind`)


def tagged(kinds: Dict[str, Any], why: str, key: str = "type", at: str = ".type") -> Any:
  """An object whose `key` picks its model among `kinds`; one whose `key` is none of them fails saying `why` (of its `at`)."""
  def kind_of(value: Any) -> Optional[str]:
    return f"<{value[key]}>" if isinstance(value, dict) and isinstance(value.get(key), str) and value[key] in kinds else None
  return Annotated[Union[tuple(Annotated[model, Tag(f"<{tag}>")] for tag, model in kinds.items())],
                   Discriminator(kind_of, custom_error_type="invalid", custom_error_message=why, custom_error_context={"at": at, "said": ""})]


def number(low: float, high: float, why: Optional[str] = None) -> Any:
  """A finite JSON number (never a boolean) in [low, high]."""
  return checked(Annotated[float, Field(strict=True, ge=low, le=high, allow_inf_nan=False)], why or f"must be a number between {low:g} and {high:g}")


def integer(low: int, why: str, high: int = MAX_INT32, optional: bool = True) -> Any:
  return checked(Annotated[int, Field(strict=True, ge=low, le=high)], why, optional=optional)


def one_of(values: Iterable[Any], why: str, code: Optional[str] = None, optional: bool = True) -> Any:
  """One of `values` (compared as `_same`: false is not 0), or null when `optional`."""
  values = tuple(values)

  def check(value: Any) -> Any:
    if (value is not None or not optional) and not any(_same(value, v) for v in values):
      raise invalid(why, code)
    return value
  return Annotated[Any, PlainValidator(check)]


def neutral(*values: Any) -> Any:
  """A parameter this server does not implement: taken only with a value that asks for nothing (null is always one)."""
  return one_of(values, f"is not supported by this server (only null or {' or '.join(json.dumps(v) for v in values)})", "unsupported_parameter")


def _same(value: Any, neutral: Any) -> bool:
  """Equal and of the same kind (so `false` is not taken for 0, nor 0 for `false`)."""
  return isinstance(value, bool) == isinstance(neutral, bool) and type(value) in (int, float, bool, dict, str, list) and value == neutral


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


Switch = checked(Annotated[bool, Field(strict=True)], "must be true or false")  # true, false, or null: not said


def flag(default: bool) -> Any:
  """true or false; null (or left out) is `default`."""
  return Annotated[Switch, AfterValidator(lambda value: default if value is None else value)]


Flag = flag(False)
Text = checked(Annotated[str, Field(strict=True)], "must be a string")
String = checked(Annotated[str, Field(strict=True)], "must be a string", optional=False)
Object = checked(Dict[str, Any], "must be an object")
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
  """The sampling fields every dialect with sampling takes, under the names OpenAI and vLLM give them."""
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
  def _min_within_budget(self):
    if self.min_tokens is not None and self.budget() is not None and self.min_tokens > self.budget():
      raise BadRequest("min_tokens must be an integer >= 0 and at most the token budget", param="min_tokens")
    return self

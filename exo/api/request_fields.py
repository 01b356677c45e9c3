"""The fields every dialect's requests share, read and checked: the body as JSON, the model, numbers, sampling
parameters, stop strings, flags. Bad input raises BadRequest naming the field (with `prefix`, a field inside an
object such as Ollama's `options.top_k`) and saying why; a field a dialect does not implement is refused the same
way (`refuse_unimplemented`), never silently ignored."""
import json
import re
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

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


def number(body: Mapping, name: str, default: float, low: float, high: float, why: str, prefix: str = "") -> float:
  value = body.get(name)
  if value is None:
    return default
  if not is_number(value) or not low <= value <= high:
    raise BadRequest(f"{prefix}{name} must be {why}", param=prefix + name)
  return float(value)


def max_tokens(body: Mapping, names: Iterable[str] = ("max_completion_tokens", "max_tokens"), prefix: str = "") -> Optional[int]:
  """The first of `names` that is given (OpenAI's max_completion_tokens wins over the older max_tokens)."""
  for name in names:
    value = body.get(name)
    if value is not None:
      if not is_int(value) or not 1 <= value <= MAX_INT32:
        raise BadRequest(f"{prefix}{name} must be an integer >= 1 (and at most {MAX_INT32})", param=prefix + name)
      return value
  return None


def seed(body: Mapping, prefix: str = "") -> Optional[int]:
  value = body.get("seed")
  if value is None:
    return None
  if not is_int(value) or not -2**63 <= value < 2**64:
    raise BadRequest(f"{prefix}seed must be an integer (64-bit)", param=prefix + "seed")
  return value % 2**64  # OpenAI allows negative seeds; the generator wants an unsigned one


def top_k(body: Mapping, prefix: str = "") -> int:
  value = body.get("top_k")
  if value is not None and (not is_int(value) or not 0 <= value <= MAX_INT32):
    raise BadRequest(f"{prefix}top_k must be an integer >= 0 (0 means no limit; at most {MAX_INT32})", param=prefix + "top_k")
  return value or 0


def parse_stop(body: Mapping, name: str = "stop", limit: int = MAX_STOP_STRINGS, prefix: str = "") -> List[str]:
  value = body.get(name)
  if value is None:
    return []
  stops = [value] if isinstance(value, str) else value
  if not isinstance(stops, list) or len(stops) > limit or not all(isinstance(s, str) and s for s in stops):
    raise BadRequest(f"{prefix}{name} must be a non-empty string or a list of at most {limit} non-empty strings", param=prefix + name)
  return stops


def parse_flag(body: Mapping, name: str, default: bool = False) -> bool:
  value = body.get(name)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise BadRequest(f"{name} must be true or false", param=name)
  return value


def parse_n(body: Mapping) -> int:
  n = body.get("n")
  if n is None:
    return 1
  if not is_int(n) or not 1 <= n <= MAX_CHOICES:
    raise BadRequest(f"n must be an integer between 1 and {MAX_CHOICES}", param="n")
  return n


def parse_logprobs_count(body: Mapping, name: str) -> Optional[int]:
  """An integer count of alternatives, 0 to MAX_TOP_LOGPROBS, or None."""
  value = body.get(name)
  if value is not None and (not is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS):
    raise BadRequest(f"{name} must be an integer between 0 and {MAX_TOP_LOGPROBS}", param=name)
  return value


def parse_stream_options(body: Mapping) -> bool:
  """Whether the stream ends with the usage."""
  options = body.get("stream_options")
  if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool)):
    raise BadRequest('stream_options must be an object like {"include_usage": true}', param="stream_options")
  return bool((options or {}).get("include_usage"))


def parse_string(body: Mapping, name: str, prefix: str = "") -> Optional[str]:
  value = body.get(name)
  if value is not None and not isinstance(value, str):
    raise BadRequest(f"{prefix}{name} must be a string", param=prefix + name)
  return value


def parse_user(body: Mapping) -> None:
  parse_string(body, "user")


def sampling_params(body: Mapping, default_temperature: float, max_tokens_names: Iterable[str] = ("max_completion_tokens", "max_tokens"),
                    prefix: str = "", max_temperature: float = 2.0) -> SamplingParams:
  """temperature, top_p, top_k, min_p, seed, the reply's token budget, ignore_eos and the logit processors
  (frequency_penalty, presence_penalty, repetition_penalty, logit_bias, min_tokens), under the names OpenAI and vLLM
  give them."""
  budget = max_tokens(body, max_tokens_names, prefix)
  return SamplingParams(
    temperature=number(body, "temperature", default_temperature, 0.0, max_temperature, f"a number between 0 and {max_temperature:g}", prefix),
    top_p=number(body, "top_p", 1.0, 0.0, 1.0, "a number between 0 and 1", prefix),
    top_k=top_k(body, prefix),
    min_p=number(body, "min_p", 0.0, 0.0, 1.0, "a number between 0 and 1", prefix),
    seed=seed(body, prefix),
    max_tokens=budget,
    ignore_eos=parse_flag(body, "ignore_eos"),
    frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0, "a number between -2 and 2", prefix),
    presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0, "a number between -2 and 2", prefix),
    repetition_penalty=repetition_penalty(body, "repetition_penalty", prefix),
    logit_bias=logit_bias(body, prefix),
    min_tokens=min_tokens(body, budget, prefix),
  )


def repetition_penalty(body: Mapping, name: str, prefix: str = "") -> float:
  return number(body, name, 1.0, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                f"a number between {MIN_REPETITION_PENALTY:g} and {MAX_REPETITION_PENALTY:g} (1 means none)", prefix)


def logit_bias(body: Mapping, prefix: str = "") -> Tuple[Tuple[int, float], ...]:
  """OpenAI's map of token ids (as strings, JSON's keys) to a bias between -100 and 100."""
  value = body.get("logit_bias")
  if value is None:
    return ()
  where = prefix + "logit_bias"
  if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
    raise BadRequest(f'{where} must be an object mapping token ids to a bias, such as {{"1734": -100}} (at most {MAX_LOGIT_BIAS} tokens)', param=where)
  out = []
  for key, bias in value.items():
    if not re.fullmatch(r"[0-9]{1,10}", str(key)) or int(key) > MAX_INT32:
      raise BadRequest(f"{where} keys must be token ids (integers >= 0), got {key!r}", param=where)
    if not is_number(bias) or not -100 <= bias <= 100:
      raise BadRequest(f"{where}[{key!r}] must be a number between -100 and 100 (-100 bans the token)", param=f"{where}.{key}")
    out.append((int(key), float(bias)))
  return tuple(sorted(out))


def min_tokens(body: Mapping, budget: Optional[int], prefix: str = "") -> int:
  value = body.get("min_tokens")
  if value is None:
    return 0
  if not is_int(value) or not 0 <= value <= MAX_INT32 or (budget is not None and value > budget):
    raise BadRequest(f"{prefix}min_tokens must be an integer >= 0 and at most the token budget", param=prefix + "min_tokens")
  return value


def _same(value: Any, neutral: Any) -> bool:
  """Equal and of the same kind (so `false` is not taken for 0, nor 0 for `false`)."""
  return isinstance(value, bool) == isinstance(neutral, bool) and type(value) in (int, float, bool, dict, str, list) and value == neutral


def refuse_unimplemented(body: Mapping, implemented: Iterable[str], neutral_values: Mapping[str, list], prefix: str = "") -> None:
  """BadRequest for a field that is neither implemented nor given one of its neutral values (null is always one)."""
  for name, value in body.items():
    if name in neutral_values:
      if value is not None and not any(_same(value, n) for n in neutral_values[name]):
        allowed = " or ".join(json.dumps(n) for n in neutral_values[name])
        raise BadRequest(f"{prefix}{name} is not supported by this server (only null or {allowed})", param=prefix + name, code="unsupported_parameter")
    elif name not in implemented:
      raise BadRequest(f"Unrecognized request argument supplied: {prefix}{name}", param=prefix + name, code="unsupported_parameter")

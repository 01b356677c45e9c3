"""Reading a request body and a chat-completion request: which model, which messages, which sampling parameters.
Bad input raises BadRequest naming the field and saying why; a parameter this server does not implement is
refused the same way, never silently ignored."""
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional

from exo.api.errors import BadRequest
from exo.api.structured import ResponseFormat, parse_response_format
from exo.api.tools import ToolUse, check_tool_messages, parse_tool_use
from exo.inference.sampling import MAX_TOP_LOGPROBS, SamplingParams
from exo.local_checkpoints import model_card
from exo.models import get_repo, model_cards

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_JSON_DEPTH = 64  # far beyond any real request; deeper bodies would exhaust recursion in templating
MAX_INT32 = 2**31 - 1
IMAGE_PLACEHOLDER = "[An image was uploaded but is not displayed here]"
ROLES = {"system", "user", "assistant", "tool", "developer"}
# A JSON string escape that may decode to half of a surrogate pair (only escapes can: the body is strict UTF-8).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")

MAX_CHOICES = 16  # n (times the prompts, on /v1/completions): each choice is a request of its own
IMPLEMENTED = {"model", "messages", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
               "max_completion_tokens", "stop", "tools", "tool_choice", "parallel_tool_calls", "response_format", "n", "ignore_eos", "user",
               "logprobs", "top_logprobs"}
# OpenAI parameters this server does not implement, with the values that ask for nothing (null is always one).
NEUTRAL_VALUES = {"frequency_penalty": [0], "presence_penalty": [0], "repetition_penalty": [1], "logit_bias": [{}]}


@dataclass
class ChatRequest:
  model: str
  messages: List[Dict[str, Any]]
  stream: bool = False
  params: SamplingParams = field(default_factory=SamplingParams)
  stop: List[str] = field(default_factory=list)
  tools: Optional[List[Any]] = None  # as given, for the chat template (none when tool_choice is "none")
  include_usage: bool = False
  n: int = 1
  response_format: Optional[ResponseFormat] = None
  tool_use: Optional[ToolUse] = None  # what calls the answer may hold (None: no tool may be called)


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


def resolve_model(requested: Any, default_model: str, engine_classname: str) -> str:
  """The registry id (or served local checkpoint path, see exo/local_checkpoints.py) a request runs on.

  Upstream's fallbacks are kept: an omitted, null or empty `model`, and any `gpt-*` name (OpenAI clients send those
  by habit), mean the default model. Unlike upstream, a name that is neither a registry id nor such a fallback is
  rejected (400, listing the supported models) instead of silently answering from the default model: a typo in a
  model name should not get an answer from a different model. A registry id that this node's engine cannot run is a
  400 with the same message, as upstream."""
  if requested is not None and not isinstance(requested, str):
    raise BadRequest("model must be a string", param="model")
  model = default_model if not requested or requested.startswith("gpt-") else requested
  try:
    model_card(model)  # a local checkpoint's path joins the registry here, if this node serves it
  except ValueError as e:
    raise BadRequest(str(e)) from None
  if get_repo(model, engine_classname) is None:
    raise BadRequest(f"Unsupported model: {model} with inference engine {engine_classname}. "
                     f"Supported models for this engine: {supported_models(engine_classname)}", param="model", code="model_not_found")
  return model


def _is_number(value: Any) -> bool:
  # Compared, not converted: math.isfinite(10**400) raises, a comparison of any int with a float does not.
  return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value and abs(value) != float("inf")


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float, why: str) -> float:
  value = body.get(name)
  if value is None:
    return default
  if not _is_number(value) or not low <= value <= high:
    raise BadRequest(f"{name} must be {why}", param=name)
  return float(value)


def _max_tokens(body: dict) -> Optional[int]:
  """max_completion_tokens (OpenAI's current name) wins over the older max_tokens."""
  for name in ("max_completion_tokens", "max_tokens"):
    value = body.get(name)
    if value is not None:
      if not _is_int(value) or not 1 <= value <= MAX_INT32:
        raise BadRequest(f"{name} must be an integer >= 1 (and at most {MAX_INT32})", param=name)
      return value
  return None


def _seed(body: dict) -> Optional[int]:
  value = body.get("seed")
  if value is None:
    return None
  if not _is_int(value) or not -2**63 <= value < 2**64:
    raise BadRequest("seed must be an integer (64-bit)", param="seed")
  return value % 2**64  # OpenAI allows negative seeds; the generator wants an unsigned one


def parse_stop(body: dict) -> List[str]:
  value = body.get("stop")
  if value is None:
    return []
  stops = [value] if isinstance(value, str) else value
  if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
    raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
  return stops


def parse_flag(body: dict, name: str) -> bool:
  value = body.get(name)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise BadRequest(f"{name} must be true or false", param=name)
  return value


def parse_n(body: dict) -> int:
  n = body.get("n")
  if n is None:
    return 1
  if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
    raise BadRequest(f"n must be an integer between 1 and {MAX_CHOICES}", param="n")
  return n


def parse_logprobs_count(body: dict, name: str) -> Optional[int]:
  """An integer count of alternatives, 0 to MAX_TOP_LOGPROBS, or None."""
  value = body.get(name)
  if value is not None and (not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS):
    raise BadRequest(f"{name} must be an integer between 0 and {MAX_TOP_LOGPROBS}", param=name)
  return value


def _chat_logprobs(body: dict) -> Optional[int]:
  """OpenAI's chat fields: `logprobs` true asks for each token's logprob, `top_logprobs` for that many alternatives."""
  top = parse_logprobs_count(body, "top_logprobs")
  if not parse_flag(body, "logprobs"):
    if top is not None:
      raise BadRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
    return None
  return top or 0


def parse_stream_options(body: dict) -> bool:
  """Whether the stream ends with the usage."""
  options = body.get("stream_options")
  if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool)):
    raise BadRequest('stream_options must be an object like {"include_usage": true}', param="stream_options")
  return bool((options or {}).get("include_usage"))


def parse_user(body: dict) -> None:
  user = body.get("user")
  if user is not None and not isinstance(user, str):
    raise BadRequest("user must be a string", param="user")


def sampling_params(body: dict, default_temperature: float) -> SamplingParams:
  top_k = body.get("top_k")
  if top_k is not None and (not _is_int(top_k) or not 0 <= top_k <= MAX_INT32):
    raise BadRequest(f"top_k must be an integer >= 0 (0 means no limit; at most {MAX_INT32})", param="top_k")
  return SamplingParams(
    temperature=_number(body, "temperature", default_temperature, 0.0, 2.0, "a number between 0 and 2"),
    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, "a number between 0 and 1"),
    top_k=top_k or 0,
    min_p=_number(body, "min_p", 0.0, 0.0, 1.0, "a number between 0 and 1"),
    seed=_seed(body),
    max_tokens=_max_tokens(body),
    ignore_eos=parse_flag(body, "ignore_eos"),
  )


def _same(value: Any, neutral: Any) -> bool:
  """Equal and of the same kind (so `false` is not taken for 0, nor 0 for `false`)."""
  return isinstance(value, bool) == isinstance(neutral, bool) and type(value) in (int, float, bool, dict) and value == neutral


def refuse_unimplemented(body: dict, implemented=IMPLEMENTED, neutral_values=NEUTRAL_VALUES) -> None:
  for name, value in body.items():
    if name in neutral_values:
      if value is not None and not any(_same(value, n) for n in neutral_values[name]):
        allowed = " or ".join(json.dumps(n) for n in neutral_values[name])
        raise BadRequest(f"{name} is not supported by this server (only null or {allowed})", param=name, code="unsupported_parameter")
    elif name not in implemented:
      raise BadRequest(f"Unrecognized request argument supplied: {name}", param=name, code="unsupported_parameter")


def _text_of(content: Any, where: str) -> str:
  """Message content as the text a text-only model sees: parts joined, images as a placeholder."""
  if content is None or isinstance(content, str):
    return content or ""
  if not isinstance(content, list):
    raise BadRequest(f"{where}.content must be a string or a list of content parts", param=f"{where}.content")
  texts = []
  for i, part in enumerate(content):
    if isinstance(part, str):
      texts.append(part)
    elif isinstance(part, dict) and part.get("type") in ("image_url", "image"):
      texts.append(IMAGE_PLACEHOLDER)
    elif isinstance(part, dict) and isinstance(part.get("text"), str):
      texts.append(part["text"])
    else:
      raise BadRequest(f"{where}.content[{i}] must be a text part ({{\"type\": \"text\", \"text\": ...}}) or an image part", param=f"{where}.content[{i}]")
  return "\n".join(texts)


def parse_messages(messages: Any, required: bool = True) -> List[Dict[str, Any]]:
  """Validated messages, each a copy with string content (extra keys such as a per-message `tools` kept). A
  `developer` message is what OpenAI now calls a system message, and goes to the template as one."""
  if messages is None and not required:
    return []
  if not isinstance(messages, list) or (required and not messages):
    raise BadRequest('messages is required: a non-empty list of {"role": ..., "content": ...} objects', param="messages")
  out = []
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
      raise BadRequest(f'{where} must be an object with a string "role" and a "content"', param=where)
    if message["role"] not in ROLES:
      raise BadRequest(f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {message['role']!r}", param=f"{where}.role")
    role = "system" if message["role"] == "developer" else message["role"]
    out.append({**message, "role": role, "content": _text_of(message["content"], where)})
  return out


def parse_tools(body: dict) -> Optional[List[Any]]:
  """The tools the chat template is given (none when tool_choice is "none"), each checked (exo/api/tools.py)."""
  parse_tool_use(body)
  return None if body.get("tool_choice") == "none" else body.get("tools")


def parse_chat_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> ChatRequest:
  refuse_unimplemented(body)
  model = resolve_model(body.get("model"), default_model, engine_classname)
  messages = parse_messages(body.get("messages"))
  check_tool_messages(messages)
  stream = parse_flag(body, "stream")
  parse_user(body)
  params = replace(sampling_params(body, default_temperature), logprobs=_chat_logprobs(body))
  tool_use = parse_tool_use(body)
  template_tools = None if body.get("tool_choice") == "none" else body.get("tools")
  return ChatRequest(model, messages, stream, params, parse_stop(body), template_tools, parse_stream_options(body), parse_n(body),
                     parse_response_format(body), tool_use)


def build_prompt(tokenizer, messages: List[Dict[str, Any]], tools: Optional[List[Any]] = None, system_prompt: Optional[str] = None) -> str:
  """The templated prompt. A node-wide system prompt goes first unless the request brings its own."""
  if system_prompt and not any(m.get("role") == "system" for m in messages):
    messages = [{"role": "system", "content": system_prompt}] + messages
  extra = {"tools": tools} if tools else {}
  try:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
  except Exception as e:  # the template rejects this conversation (e.g. roles out of order)
    raise BadRequest(f"messages could not be formatted with the model's chat template: {e}", param="messages") from None

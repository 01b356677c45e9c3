"""Reading a chat-completion request: which model, which messages, which sampling parameters. Bad input raises
BadRequest with a message that names the field and says why; the API answers it with HTTP 400."""
import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from exo.inference.sampling import SamplingParams
from exo.local_checkpoints import model_card
from exo.models import get_repo, model_cards

MAX_STOP_STRINGS = 4  # as OpenAI's API
IMAGE_PLACEHOLDER = "[An image was uploaded but is not displayed here]"


class BadRequest(Exception):
  """The client's mistake; str(self) is the `detail` of the 400 reply."""


@dataclass
class ChatRequest:
  model: str
  messages: List[Dict[str, Any]]
  stream: bool = False
  params: SamplingParams = field(default_factory=SamplingParams)
  stop: List[str] = field(default_factory=list)
  tools: Optional[List[Any]] = None
  include_usage: bool = False


def parse_json_object(raw: str) -> Dict[str, Any]:
  try:
    body = json.loads(raw)
  except ValueError as e:
    raise BadRequest(f"Invalid JSON body: {e}") from None
  if not isinstance(body, dict):
    raise BadRequest("Request body must be a JSON object")
  return body


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
    raise BadRequest("model must be a string")
  model = default_model if not requested or requested.startswith("gpt-") else requested
  try:
    model_card(model)  # a local checkpoint's path joins the registry here, if this node serves it
  except ValueError as e:
    raise BadRequest(str(e)) from None
  if get_repo(model, engine_classname) is None:
    raise BadRequest(f"Unsupported model: {model} with inference engine {engine_classname}. "
                     f"Supported models for this engine: {supported_models(engine_classname)}")
  return model


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _number(body: dict, name: str, default: float, low: float, high: float, why: str) -> float:
  value = body.get(name)
  if value is None:
    return default
  if not _is_number(value) or not low <= value <= high:
    raise BadRequest(f"{name} must be {why}")
  return float(value)


def _max_tokens(body: dict) -> Optional[int]:
  """max_completion_tokens (OpenAI's current name) wins over the older max_tokens."""
  for name in ("max_completion_tokens", "max_tokens"):
    value = body.get(name)
    if value is not None:
      if not _is_int(value) or value < 1:
        raise BadRequest(f"{name} must be an integer >= 1")
      return value
  return None


def _seed(body: dict) -> Optional[int]:
  value = body.get("seed")
  if value is None:
    return None
  if not _is_int(value) or not -2**63 <= value < 2**64:
    raise BadRequest("seed must be an integer (64-bit)")
  return value % 2**64  # OpenAI allows negative seeds; the generator wants an unsigned one


def _stop(body: dict) -> List[str]:
  value = body.get("stop")
  if value is None:
    return []
  stops = [value] if isinstance(value, str) else value
  if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stops):
    raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings")
  return stops


def sampling_params(body: dict, default_temperature: float) -> SamplingParams:
  top_k = body.get("top_k")
  if top_k is not None and (not _is_int(top_k) or top_k < 0):
    raise BadRequest("top_k must be an integer >= 0 (0 means no limit)")
  return SamplingParams(
    temperature=_number(body, "temperature", default_temperature, 0.0, 2.0, "a number between 0 and 2"),
    top_p=_number(body, "top_p", 1.0, 0.0, 1.0, "a number between 0 and 1"),
    top_k=top_k or 0,
    min_p=_number(body, "min_p", 0.0, 0.0, 1.0, "a number between 0 and 1"),
    seed=_seed(body),
    max_tokens=_max_tokens(body),
    ignore_eos=_flag(body, "ignore_eos"),
  )


def _flag(body: dict, name: str) -> bool:
  value = body.get(name, False)
  if not isinstance(value, bool):
    raise BadRequest(f"{name} must be true or false")
  return value


def _text_of(content: Any, where: str) -> str:
  """Message content as the text a text-only model sees: parts joined, images as a placeholder."""
  if content is None or isinstance(content, str):
    return content or ""
  if not isinstance(content, list):
    raise BadRequest(f"{where}.content must be a string or a list of content parts")
  texts = []
  for i, part in enumerate(content):
    if isinstance(part, str):
      texts.append(part)
    elif isinstance(part, dict) and part.get("type") in ("image_url", "image"):
      texts.append(IMAGE_PLACEHOLDER)
    elif isinstance(part, dict) and isinstance(part.get("text"), str):
      texts.append(part["text"])
    else:
      raise BadRequest(f"{where}.content[{i}] must be a text part ({{\"type\": \"text\", \"text\": ...}}) or an image part")
  return "\n".join(texts)


def parse_messages(messages: Any, required: bool = True) -> List[Dict[str, Any]]:
  """Validated messages, each a copy with string content (extra keys such as a per-message `tools` kept)."""
  if messages is None and not required:
    return []
  if not isinstance(messages, list) or (required and not messages):
    raise BadRequest('messages is required: a non-empty list of {"role": ..., "content": ...} objects')
  out = []
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
      raise BadRequest(f'{where} must be an object with a string "role" and a "content"')
    out.append({**message, "content": _text_of(message["content"], where)})
  return out


def parse_chat_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> ChatRequest:
  model = resolve_model(body.get("model"), default_model, engine_classname)
  messages = parse_messages(body.get("messages"))
  stream = body.get("stream", False)
  if stream is None:
    stream = False
  if not isinstance(stream, bool):
    raise BadRequest("stream must be true or false")
  n = body.get("n")
  if n is not None and n != 1:
    raise BadRequest("n must be 1: exo returns one choice")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
    raise BadRequest('stream_options must be an object like {"include_usage": true}')
  tools = body.get("tools")
  if tools is not None and not isinstance(tools, list):
    raise BadRequest("tools must be a list")
  return ChatRequest(model, messages, stream, sampling_params(body, default_temperature), _stop(body), tools, options.get("include_usage", False))


def build_prompt(tokenizer, messages: List[Dict[str, Any]], tools: Optional[List[Any]] = None, system_prompt: Optional[str] = None) -> str:
  """The templated prompt. A node-wide system prompt goes first unless the request brings its own."""
  if system_prompt and not any(m.get("role") == "system" for m in messages):
    messages = [{"role": "system", "content": system_prompt}] + messages
  extra = {"tools": tools} if tools else {}
  try:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
  except Exception as e:  # the template rejects this conversation (e.g. roles out of order)
    raise BadRequest(f"messages could not be formatted with the model's chat template: {e}") from None

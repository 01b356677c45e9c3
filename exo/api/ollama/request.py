"""Ollama's /api/chat and /api/generate bodies read into GenerationRequests: the messages (tool calls with their
arguments as objects, tool results) or the prompt (templated as a user turn, or `raw`), `options` (temperature,
top_p, top_k, min_p, seed, num_predict, stop, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty,
num_ctx), `format` ("json" or a JSON Schema), tools on chat. Ollama streams
unless told not to. Bad input is a 400 naming the field; a model this node does not have is a 404, as Ollama's."""
import json
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from exo.api.chat_request import IMAGE_PLACEHOLDER
from exo.api.errors import ApiError, BadRequest
from exo.api.generation_request import FieldNames, GenerationRequest
from exo.api.reasoning import parse_effort
from exo.api.request_fields import (MAX_INT32, is_int, parse_flag, parse_logprobs_count, parse_stop, parse_string, refuse_unimplemented,
                                    repetition_penalty, resolve_model, sampling_params)
from exo.api.structured import ResponseFormat, format_of
from exo.api.tools import parse_tool_use

MAX_STOP_STRINGS = 16
THINK_LEVELS = ("low", "medium", "high")
CHAT_FIELDS = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think", "logprobs", "top_logprobs"}
GENERATE_FIELDS = {"model", "prompt", "system", "raw", "format", "options", "stream", "keep_alive", "think", "images", "logprobs", "top_logprobs"}
GENERATE_NEUTRAL = {"suffix": [""], "template": [""], "context": [[]]}
SAMPLING_OPTIONS = {"temperature", "top_p", "top_k", "min_p", "seed", "num_predict", "stop", "repeat_penalty", "repeat_last_n", "presence_penalty",
                    "frequency_penalty", "num_ctx"}
# How a node runs (its threads, memory): the node's own settings, so these options are accepted and have no effect.
RUNTIME_OPTIONS = {"num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa", "low_vram", "num_keep", "penalize_newline",
                   "mirostat_tau", "mirostat_eta"}
NEUTRAL_OPTIONS = {"typical_p": [1], "tfs_z": [1], "mirostat": [0]}
REPEAT_LAST_N = 64  # Ollama's default window for its penalties
ROLES = {"system", "user", "assistant", "tool"}
LATEST = ":latest"


def resolve_ollama_model(body: dict, default_model: str, engine_classname: str, field: str = "model") -> str:
  """Ollama's model names with their tag: `name` and `name:latest` are the registry's `name`."""
  name = body.get(field)
  if not isinstance(name, str) or not name:
    raise BadRequest(f"{field} is required", param=field)
  try:
    return resolve_model(name.removesuffix(LATEST), default_model, engine_classname, fallback_prefixes=())
  except BadRequest as e:
    if e.code == "model_not_found":
      raise ApiError(404, f"model '{name}' not found", param=field, code="model_not_found") from None
    raise


def _options(body: dict, default_temperature: float):
  options = body.get("options") or {}
  if not isinstance(options, dict):
    raise BadRequest("options must be an object such as {\"temperature\": 0}", param="options")
  refuse_unimplemented(options, SAMPLING_OPTIONS | RUNTIME_OPTIONS, NEUTRAL_OPTIONS, prefix="options.")
  predict = options.get("num_predict")
  if predict is not None and (not is_int(predict) or not (predict in (-1, -2) or 1 <= predict <= MAX_INT32)):
    raise BadRequest("options.num_predict must be an integer >= 1, or -1 (until the context is full)", param="options.num_predict")
  fields = {k: options.get(k) for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty")}
  params = sampling_params({**fields, "num_predict": predict if predict and predict > 0 else None}, default_temperature, ("num_predict",),
                           prefix="options.")
  params = replace(params, repetition_penalty=repetition_penalty(options, "repeat_penalty", "options."), penalty_window=_repeat_last_n(options))
  return params, parse_stop(options, "stop", MAX_STOP_STRINGS, prefix="options."), _num_ctx(options)


def _repeat_last_n(options: dict) -> int:
  """How many of the last tokens (prompt and answer) the penalties count: -1 all of them, 0 none, as Ollama's."""
  value = options.get("repeat_last_n")
  if value is None:
    return REPEAT_LAST_N
  if not is_int(value) or not -1 <= value <= MAX_INT32:
    raise BadRequest("options.repeat_last_n must be an integer >= 0, or -1 (the whole context)", param="options.repeat_last_n")
  return MAX_INT32 if value == -1 else value


def _num_ctx(options: dict) -> Optional[int]:
  value = options.get("num_ctx")
  if value is not None and (not is_int(value) or not 1 <= value <= MAX_INT32):
    raise BadRequest("options.num_ctx must be an integer >= 1", param="options.num_ctx")
  return value


def _format(body: dict) -> Optional[ResponseFormat]:
  value = body.get("format")
  if value in (None, ""):
    return None
  if value == "json":
    return format_of("json_object", None, "format", "format")
  if isinstance(value, dict):
    return format_of("json_schema", {"schema": value}, "format", "format")
  raise BadRequest('format must be "json" or a JSON Schema object', param="format")


def _logprobs(body: dict) -> Optional[int]:
  top = parse_logprobs_count(body, "top_logprobs")
  return (top or 0) if parse_flag(body, "logprobs") else None


def _think(body: dict) -> Tuple[Optional[bool], Dict[str, Any]]:
  """`think`: true (a reasoning model thinks first; a model that does not is a 400), false (it answers at once, where
  its template can), absent (as its template does by default), or the levels gpt-oss takes ("low", "medium",
  "high"): it thinks, and its template reads the level as `reasoning_effort`. Returns (whether to think, or None;
  template variables)."""
  value = body.get("think")
  if value in THINK_LEVELS:
    return parse_effort(value, "think")
  if value is not None and not isinstance(value, bool):
    raise BadRequest(f"think must be true, false or one of {', '.join(THINK_LEVELS)}", param="think", code="unsupported_parameter")
  return value, {}


def _common(body: dict, default_temperature: float, fields: set, neutral: dict, prompt_field: str) -> Dict[str, Any]:
  """The GenerationRequest's fields that chat and generate share."""
  refuse_unimplemented(body, fields, neutral)
  params, stop, context = _options(body, default_temperature)
  thinking, template_kwargs = _think(body)
  return {"params": replace(params, logprobs=_logprobs(body)), "stop": stop, "response_format": _format(body), "context": context,
          "stream": parse_flag(body, "stream", default=True), "thinking": thinking, "template_kwargs": template_kwargs,
          "fields": FieldNames(prompt=prompt_field, max_tokens="options.num_predict", context="options.num_ctx", thinking="think")}


def _images(message: dict, where: str) -> str:
  images = message.get("images")
  if images is None:
    return ""
  if not isinstance(images, list):
    raise BadRequest(f"{where}.images must be a list of base64 images", param=f"{where}.images")
  return "".join("\n" + IMAGE_PLACEHOLDER for _ in images)


def parse_messages(value: Any) -> List[Dict[str, Any]]:
  """Ollama's messages as the core's conversation: tool calls get ids, and each tool result answers the earliest
  unanswered call of its `tool_name` (or, without one, the earliest unanswered call)."""
  if not isinstance(value, list):
    raise BadRequest('messages must be a list of {"role": ..., "content": ...} objects', param="messages")
  out, pending = [], []
  for i, message in enumerate(value):
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
      raise BadRequest(f'{where} must be an object with "role" one of {", ".join(sorted(ROLES))}', param=where)
    content = parse_string(message, "content", f"{where}.") or ""
    converted = {"role": message["role"], "content": content + _images(message, where)}
    calls = message.get("tool_calls")
    if calls is not None:
      if message["role"] != "assistant" or not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list, on an assistant message", param=f"{where}.tool_calls")
      converted["tool_calls"] = []
      for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not isinstance(function.get("arguments", {}), dict):
          raise BadRequest(f'{where}.tool_calls[{j}] must be {{"function": {{"name": ..., "arguments": {{...}}}}}}', param=f"{where}.tool_calls[{j}]")
        call_id = f"call_{i}_{j}"
        converted["tool_calls"].append({"id": call_id, "type": "function", "function": {"name": function["name"],
                                                                                         "arguments": json.dumps(function.get("arguments", {}))}})
        pending.append((call_id, function["name"]))
    if message["role"] == "tool":
      name = parse_string(message, "tool_name", f"{where}.")
      answered = next((p for p in pending if name is None or p[1] == name), None)
      if answered is not None:
        pending.remove(answered)
        converted["tool_call_id"] = answered[0]
    out.append(converted)
  return out


def parse_chat(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  common = _common(body, default_temperature, CHAT_FIELDS, {}, "messages")
  model = resolve_ollama_model(body, default_model, engine_classname)
  messages = parse_messages(body.get("messages") or [])
  if not messages:
    raise BadRequest("messages is required: a non-empty list", param="messages")  # (Ollama loads the model; this node's is always loaded)
  return GenerationRequest(model, messages=messages, tool_use=parse_tool_use({"tools": body.get("tools")}), **common)


def parse_generate(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  """An empty prompt (Ollama's way to load a model) is the raw prompt "", which is not to be run."""
  common = _common(body, default_temperature, GENERATE_FIELDS, GENERATE_NEUTRAL, "prompt")
  model = resolve_ollama_model(body, default_model, engine_classname)
  prompt, system = parse_string(body, "prompt") or "", parse_string(body, "system")
  if not prompt:
    return GenerationRequest(model, prompts=[""], **common)
  if parse_flag(body, "raw"):
    if system or body.get("images"):
      raise BadRequest("a raw prompt is given to the model as it is: put the system prompt and images in it", param="raw")
    return GenerationRequest(model, prompts=[prompt], **common)
  messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt + _images(body, "body")}]
  return GenerationRequest(model, messages=messages, **common)

"""OpenAI chat completions (POST /v1/chat/completions) read into a GenerationRequest: the model, the messages, the
sampling parameters, tools and response_format. Bad input raises BadRequest naming the field and saying why; a
parameter this server does not implement is refused the same way, never silently ignored."""
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from exo.api.errors import BadRequest
from exo.api.generation_request import GenerationRequest
from exo.api.reasoning import SWITCH, parse_effort
from exo.api.request_fields import (parse_flag, parse_logprobs_count, parse_n, parse_stop, parse_stream_options, parse_user, refuse_unimplemented,
                                    resolve_model, sampling_params)
from exo.api.structured import parse_response_format
from exo.api.tools import check_tool_messages, parse_tool_use

IMAGE_PLACEHOLDER = "[An image was uploaded but is not displayed here]"
ROLES = {"system", "user", "assistant", "tool", "developer"}
IMPLEMENTED = {"model", "messages", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
               "max_completion_tokens", "stop", "tools", "tool_choice", "parallel_tool_calls", "response_format", "n", "ignore_eos", "user",
               "logprobs", "top_logprobs", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens",
               "chat_template_kwargs", "reasoning_effort"}
# What the template is given by the server itself, which chat_template_kwargs may not replace.
TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
# OpenAI parameters this server does not implement, with the values that ask for nothing (null is always one).
NEUTRAL_VALUES: Dict[str, list] = {}


def _chat_logprobs(body: dict) -> Optional[int]:
  """OpenAI's chat fields: `logprobs` true asks for each token's logprob, `top_logprobs` for that many alternatives."""
  top = parse_logprobs_count(body, "top_logprobs")
  if not parse_flag(body, "logprobs"):
    if top is not None:
      raise BadRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
    return None
  return top or 0


def text_of(content: Any, where: str) -> str:
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
    out.append({**message, "role": role, "content": text_of(message["content"], where)})
  return out


def parse_tools(body: dict) -> Optional[List[Any]]:
  """The tools the chat template is given (none when tool_choice is "none"), each checked (exo/api/tools.py)."""
  parse_tool_use(body)
  return None if body.get("tool_choice") == "none" else body.get("tools")


def parse_template_kwargs(body: dict) -> Tuple[Optional[bool], Dict[str, Any]]:
  """vLLM's `chat_template_kwargs`: variables for the chat template, `enable_thinking` (Qwen3's switch) among them.
  Returns (whether to think, or None; the other variables)."""
  value = body.get("chat_template_kwargs")
  if value is None:
    return None, {}
  if not isinstance(value, dict):
    raise BadRequest('chat_template_kwargs must be an object such as {"enable_thinking": false}', param="chat_template_kwargs")
  reserved = sorted(set(value) & TEMPLATE_OWN)
  if reserved:
    raise BadRequest(f"chat_template_kwargs.{reserved[0]} is the request's own to set", param=f"chat_template_kwargs.{reserved[0]}")
  thinking = value.get(SWITCH)
  if thinking is not None and not isinstance(thinking, bool):
    raise BadRequest(f"chat_template_kwargs.{SWITCH} must be true or false", param=f"chat_template_kwargs.{SWITCH}")
  return thinking, {k: v for k, v in value.items() if k != SWITCH}


def parse_chat_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  refuse_unimplemented(body, IMPLEMENTED, NEUTRAL_VALUES)
  model = resolve_model(body.get("model"), default_model, engine_classname)
  messages = parse_messages(body.get("messages"))
  check_tool_messages(messages)
  stream = parse_flag(body, "stream")
  parse_user(body)
  params = replace(sampling_params(body, default_temperature), logprobs=_chat_logprobs(body))
  thinking, template_kwargs = parse_template_kwargs(body)
  # OpenAI's reasoning_effort: "none" turns thinking off where the template can; gpt-oss's template reads the degree.
  # chat_template_kwargs, the more explicit, win where both speak.
  effort_thinking, effort_kwargs = parse_effort(body.get("reasoning_effort"), "reasoning_effort")
  thinking, template_kwargs = (thinking if thinking is not None else effort_thinking), {**effort_kwargs, **template_kwargs}
  return GenerationRequest(model, messages=messages, params=params, stop=parse_stop(body), tool_use=parse_tool_use(body),
                           response_format=parse_response_format(body), n=parse_n(body), stream=stream, stream_usage=parse_stream_options(body),
                           thinking=thinking, template_kwargs=template_kwargs)

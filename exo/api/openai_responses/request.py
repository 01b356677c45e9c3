"""An OpenAI Responses request read into a GenerationRequest: `input` (a string, or items: messages,
function_call and function_call_output) after `instructions`, max_output_tokens, temperature, top_p, function tools
and tool_choice, text.format. Nothing is stored here, so what needs a stored response (previous_response_id,
conversation, item references, background) is a 400, as are tools that run on OpenAI's servers."""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from exo.api.chat_request import IMAGE_PLACEHOLDER
from exo.api.errors import BadRequest
from exo.api.generation_request import FieldNames, GenerationRequest
from exo.api.reasoning import parse_effort
from exo.api.request_fields import parse_flag, parse_string, refuse_unimplemented, resolve_model, sampling_params
from exo.api.structured import ResponseFormat, format_of
from exo.api.tools import Tool, parse_tools, tool_of, tool_use

IMPLEMENTED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice", "parallel_tool_calls",
               "text", "stream", "store", "metadata", "user", "safety_identifier", "prompt_cache_key", "include", "previous_response_id",
               "conversation", "reasoning"}
NEUTRAL_VALUES = {"truncation": ["disabled"], "background": [False], "service_tier": ["auto", "default"], "top_logprobs": [0]}
# What `include` may ask for: encrypted reasoning (Codex asks; nothing is encrypted: a reasoning model's thinking comes as
# plain reasoning_text).
INCLUDABLE = {"reasoning.encrypted_content"}
STATELESS = "this server stores no responses: send the whole conversation in `input`"
TEXT_PARTS = {"input_text", "output_text", "text"}
MESSAGE_ROLES = {"user", "assistant", "system", "developer"}


@dataclass
class ResponsesRequest:
  generation: GenerationRequest
  echo: Dict[str, Any]  # the request's settings, as the response object repeats them


def _content_text(content: Any, where: str) -> str:
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise BadRequest(f"{where} must be a string or a list of content parts", param=where)
  texts = []
  for j, part in enumerate(content):
    at = f"{where}[{j}]"
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
      texts.append(part["text"])
    elif kind == "refusal" and isinstance(part.get("refusal"), str):
      texts.append(part["refusal"])
    elif kind in ("input_image", "input_file", "input_audio"):
      texts.append(IMAGE_PLACEHOLDER)
    else:
      raise BadRequest(f'{at} must be a text part ({{"type": "input_text", "text": ...}}) or an image or file part', param=at)
  return "\n".join(texts)


def _function_call(item: dict, where: str) -> dict:
  for key in ("call_id", "name", "arguments"):
    if not isinstance(item.get(key), str):
      raise BadRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
  return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}


def parse_input(value: Any, instructions: Optional[str]) -> List[Dict[str, Any]]:
  """`instructions` and `input` as the core's conversation (OpenAI chat's form)."""
  out = [{"role": "system", "content": instructions}] if instructions else []
  if isinstance(value, str):
    return out + [{"role": "user", "content": value}]
  if not isinstance(value, list) or not value:
    raise BadRequest("input is required: a string, or a non-empty list of input items", param="input")
  for i, item in enumerate(value):
    where = f"input[{i}]"
    if not isinstance(item, dict):
      raise BadRequest(f"{where} must be an input item (an object)", param=where)
    kind = item.get("type", "message")
    if kind == "message":
      if item.get("role") not in MESSAGE_ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(sorted(MESSAGE_ROLES))}", param=f"{where}.role")
      role = "system" if item["role"] == "developer" else item["role"]
      out.append({"role": role, "content": _content_text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
      call = _function_call(item, where)
      if out and out[-1]["role"] == "assistant":  # the calls of one turn, after its text, are one assistant message
        out[-1].setdefault("tool_calls", []).append(call)
      else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
      if not isinstance(item.get("call_id"), str):
        raise BadRequest(f"{where}.call_id must be a string", param=f"{where}.call_id")
      out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _content_text(item.get("output"), f"{where}.output")})
    elif kind == "item_reference":
      raise BadRequest(f"{where}: an item_reference needs a stored item; {STATELESS}", param=where, code="unsupported_parameter")
    elif kind != "reasoning":  # (earlier reasoning is not part of the prompt, as reasoning models' templates drop it)
      raise BadRequest(f'{where}.type {kind!r} is not served here: input items are messages, "function_call" and "function_call_output"',
                       param=f"{where}.type")
  return out


def _function_tool(item: dict, where: str) -> Tool:
  if item.get("type") != "function":
    raise BadRequest(f'{where}.type {item.get("type")!r}: only "function" tools are served here; the others (web search, file search, '
                     "computer use, code interpreter, MCP, ...) run on OpenAI's servers", param=f"{where}.type", code="unsupported_parameter")
  return tool_of({**item, "strict": item.get("strict", True)}, where)  # the Responses API's function tools are strict unless told


def _tool_use(body: dict):
  tools = parse_tools(body, _function_tool, '{"type": "function", "name": ..., "parameters": {...}}', "tools[{i}].name")
  choice, name = body.get("tool_choice"), None
  why = 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'
  if isinstance(choice, dict):
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
      raise BadRequest(why, param="tool_choice")
    choice, name = "function", choice["name"]
  elif choice is not None and choice not in ("none", "auto", "required"):
    raise BadRequest(why, param="tool_choice")
  return tool_use(tools, choice, name, parse_flag(body, "parallel_tool_calls", default=True))


def _text_format(body: dict) -> Tuple[Optional[ResponseFormat], dict]:
  """text.format (a json_schema's fields sit beside its type, unlike chat's response_format) and the text settings."""
  text = body.get("text")
  if text is None:
    return None, {"format": {"type": "text"}}
  if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
    raise BadRequest('text must be an object such as {"format": {"type": "json_schema", ...}}', param="text")
  if text.get("verbosity") not in (None, "medium"):
    raise BadRequest("text.verbosity: only medium is served here", param="text.verbosity", code="unsupported_parameter")
  spec = text.get("format") or {"type": "text"}
  if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
    raise BadRequest('text.format must be an object such as {"type": "json_object"}', param="text.format")
  return format_of(spec["type"], spec, "text.format", "text.format"), {"format": spec}


def _refuse_state(body: dict) -> None:
  for name in ("previous_response_id", "conversation"):
    if body.get(name) is not None:
      raise BadRequest(f"{name}: {STATELESS}", param=name, code="unsupported_parameter")
  include = body.get("include")
  if include is not None and (not isinstance(include, list) or not all(isinstance(i, str) and i in INCLUDABLE for i in include)):
    raise BadRequest(f"include may only hold {sorted(INCLUDABLE)} here", param="include", code="unsupported_parameter")


def _reasoning(body: dict) -> Tuple[Optional[bool], Dict[str, Any]]:
  """`reasoning`: its `effort` "none" makes a reasoning model answer at once (where its template can), another
  effort makes it think (a model that does not reason: 400); the degree goes to a template that reads it (gpt-oss's
  low, medium, high) and otherwise does not change how long it thinks. `summary` is accepted: no summary is
  written, the thinking itself comes back as reasoning_text. Returns (whether to think, or None; template variables)."""
  value = body.get("reasoning")
  if value is None:
    return None, {}
  if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary"}:
    raise BadRequest('reasoning must be an object such as {"effort": "medium"}', param="reasoning")
  return parse_effort(value.get("effort"), "reasoning.effort")


def parse_responses_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> ResponsesRequest:
  refuse_unimplemented(body, IMPLEMENTED, NEUTRAL_VALUES)
  _refuse_state(body)
  model = resolve_model(body.get("model"), default_model, engine_classname)
  instructions = parse_string(body, "instructions")
  messages = parse_input(body.get("input"), instructions)
  for name in ("user", "safety_identifier", "prompt_cache_key"):
    parse_string(body, name)
  parse_flag(body, "store")  # (accepted either way: nothing is stored)
  metadata = body.get("metadata")
  if metadata is not None and not isinstance(metadata, dict):
    raise BadRequest("metadata must be an object of strings", param="metadata")
  params = sampling_params({k: body.get(k) for k in ("temperature", "top_p", "max_output_tokens")}, default_temperature, ("max_output_tokens",))
  use = _tool_use(body)
  response_format, text = _text_format(body)
  thinking, template_kwargs = _reasoning(body)
  generation = GenerationRequest(model, messages=messages, params=params, tool_use=use, response_format=response_format, thinking=thinking,
                                 template_kwargs=template_kwargs,
                                 stream=parse_flag(body, "stream"), fields=FieldNames(prompt="input", max_tokens="max_output_tokens", thinking="reasoning.effort"))
  echo = {"instructions": instructions, "max_output_tokens": params.max_tokens, "metadata": metadata or {},
          "parallel_tool_calls": parse_flag(body, "parallel_tool_calls", default=True), "temperature": params.temperature, "text": text,
          "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [], "top_p": params.top_p, "user": body.get("user")}
  return ResponsesRequest(generation, echo)

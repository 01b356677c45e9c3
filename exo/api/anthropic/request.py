"""An Anthropic Messages request read into a GenerationRequest: the system prompt and the messages (text,
tool_use and tool_result blocks) as a conversation in the core's form, max_tokens, sampling, stop_sequences, tools
and tool_choice, output_config.format. Bad input is a 400 naming the field; fields this server does not implement
are refused."""
import json
from typing import Any, Dict, List, Optional, Tuple

from exo.api.chat_request import IMAGE_PLACEHOLDER
from exo.api.errors import BadRequest
from exo.api.generation_request import FieldNames, GenerationRequest
from exo.api.request_fields import MAX_INT32, is_int, parse_flag, parse_stop, parse_string, refuse_unimplemented, resolve_model, sampling_params
from exo.api.structured import ResponseFormat, format_of
from exo.api.tools import Tool, parse_tools, tool_of, tool_use

MAX_STOP_SEQUENCES = 16
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "output_config", "cache_control", "thinking"}
# cache_control (here and on blocks) is a caching hint: this node reuses prompt prefixes by itself. user_profile_id and
# workspace_id say whom a request is for, which changes nothing in its answer here.
IMPLEMENTED = COUNT_FIELDS | {"max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k", "metadata", "user_profile_id", "workspace_id"}
# Fields that ask for nothing this server does not do, with those values (null is always one).
NEUTRAL_VALUES = {"service_tier": ["auto", "standard_only"], "speed": ["standard"]}
# Clients name Anthropic's models by habit (Claude Code asks for claude-* models): those mean the default model.
FALLBACK_PREFIXES = ("claude-",)


def _blocks(content: Any, where: str) -> List[dict]:
  """Content as a list of blocks, each an object with a string type."""
  if isinstance(content, str):
    return [{"type": "text", "text": content}]
  if not isinstance(content, list):
    raise BadRequest(f"{where} must be a string or a list of content blocks", param=where)
  for j, block in enumerate(content):
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
      raise BadRequest(f'{where}[{j}] must be a content block: an object with a "type"', param=f"{where}[{j}]")
  return content


def _text(block: dict, where: str) -> str:
  if not isinstance(block.get("text"), str):
    raise BadRequest(f"{where}.text must be a string", param=f"{where}.text")
  return block["text"]


def _plain_text(content: Any, where: str) -> str:
  """Text and image blocks (a system prompt's, a tool result's) as the text a text-only model sees."""
  texts = []
  for j, block in enumerate(_blocks(content, where)):
    if block["type"] == "text":
      texts.append(_text(block, f"{where}[{j}]"))
    elif block["type"] in ("image", "document"):
      texts.append(IMAGE_PLACEHOLDER)
    else:
      raise BadRequest(f'{where}[{j}].type must be "text" or "image" here, got {block["type"]!r}', param=f"{where}[{j}].type")
  return "\n".join(texts)


def _user_turn(blocks: List[dict], where: str) -> List[Dict[str, Any]]:
  """Tool results become `tool` messages (in their order), the rest one user message after them."""
  out, texts = [], []
  for j, block in enumerate(blocks):
    at = f"{where}[{j}]"
    if block["type"] == "text":
      texts.append(_text(block, at))
    elif block["type"] in ("image", "document"):
      texts.append(IMAGE_PLACEHOLDER)
    elif block["type"] == "tool_result":
      if not isinstance(block.get("tool_use_id"), str):
        raise BadRequest(f"{at}.tool_use_id must be a string", param=f"{at}.tool_use_id")
      result = _plain_text(block.get("content", ""), f"{at}.content")
      out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": f"Error: {result}" if block.get("is_error") else result})
    else:
      raise BadRequest(f'{at}.type must be "text", "image", "document" or "tool_result" in a user message, got {block["type"]!r}',
                       param=f"{at}.type")
  if texts or not out:
    out.append({"role": "user", "content": "\n".join(texts)})
  return out


def _assistant_turn(blocks: List[dict], where: str) -> Dict[str, Any]:
  """Text, and tool_use blocks as OpenAI-style tool_calls. Thinking blocks are left out, as Anthropic's API leaves
  earlier turns' thinking out of the prompt (and reasoning models' templates drop it)."""
  texts, calls = [], []
  for j, block in enumerate(blocks):
    at = f"{where}[{j}]"
    if block["type"] == "text":
      texts.append(_text(block, at))
    elif block["type"] == "tool_use":
      if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
        raise BadRequest(f'{at} must be {{"type": "tool_use", "id": ..., "name": ..., "input": {{...}}}}', param=at)
      calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
    elif block["type"] not in ("thinking", "redacted_thinking"):
      raise BadRequest(f'{at}.type must be "text" or "tool_use" in an assistant message, got {block["type"]!r}', param=f"{at}.type")
  message: Dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
  if calls:
    message["tool_calls"] = calls
  return message


def parse_conversation(body: dict) -> List[Dict[str, Any]]:
  """`system` and `messages` as the core's conversation (OpenAI chat's form)."""
  out = []
  system = body.get("system")
  if system is not None:
    text = _plain_text(system, "system")
    if text:
      out.append({"role": "system", "content": text})
  messages = body.get("messages")
  if not isinstance(messages, list) or not messages:
    raise BadRequest('messages is required: a non-empty list of {"role": "user" | "assistant", "content": ...} objects', param="messages")
  for i, message in enumerate(messages):
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant") or "content" not in message:
      raise BadRequest(f'{where} must be an object with "role" ("user" or "assistant") and "content"', param=where)
    blocks = _blocks(message["content"], f"{where}.content")
    if message["role"] == "user":
      out += _user_turn(blocks, f"{where}.content")
    else:
      out.append(_assistant_turn(blocks, f"{where}.content"))
  return out


def _custom_tool(item: dict, where: str) -> Tool:
  if item.get("type", "custom") != "custom":
    raise BadRequest(f'{where}.type {item["type"]!r}: only custom tools (name, description, input_schema) are served here; Anthropic\'s '
                     "server tools and its built-in client tools are not", param=f"{where}.type", code="unsupported_parameter")
  if "input_schema" not in item:
    raise BadRequest(f"{where}.input_schema is required: a JSON Schema of the tool's input object", param=f"{where}.input_schema")
  return tool_of(item, where, "input_schema")


def _tool_choice(body: dict) -> Tuple[Optional[str], Optional[str], bool]:
  """(choice, name, parallel) from Anthropic's {"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}."""
  value = body.get("tool_choice")
  if value is None:
    return None, None, True
  kinds = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
  if not isinstance(value, dict) or value.get("type") not in kinds:
    raise BadRequest('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}', param="tool_choice")
  if value["type"] == "tool" and not isinstance(value.get("name"), str):
    raise BadRequest('tool_choice {"type": "tool"} needs the tool\'s "name"', param="tool_choice.name")
  disable = value.get("disable_parallel_tool_use")
  if disable is not None and not isinstance(disable, bool):
    raise BadRequest("tool_choice.disable_parallel_tool_use must be true or false", param="tool_choice.disable_parallel_tool_use")
  return kinds[value["type"]], value.get("name"), not disable


def _output_format(body: dict) -> Optional[ResponseFormat]:
  """output_config.format: {"type": "json_schema", "schema": {...}} (followed as chat's json_schema with strict false)."""
  config = body.get("output_config")
  if config is None:
    return None
  if not isinstance(config, dict) or set(config) - {"format", "effort"}:
    raise BadRequest('output_config must be an object such as {"format": {"type": "json_schema", "schema": {...}}}', param="output_config")
  if config.get("effort") is not None:
    raise BadRequest("output_config.effort: this model does not reason (leave effort out)", param="output_config.effort", code="unsupported_parameter")
  spec = config.get("format")
  if spec is None:
    return None
  if not isinstance(spec, dict) or spec.get("type") != "json_schema" or "schema" not in spec:
    raise BadRequest('output_config.format must be {"type": "json_schema", "schema": {...}}', param="output_config.format")
  return format_of("json_schema", {"schema": spec["schema"]}, "output_config.format", "output_config.format")


def _thinking(body: dict) -> Optional[bool]:
  """`thinking`: {"type": "enabled", "budget_tokens"} or {"type": "adaptive"} (think first), {"type": "disabled"}
  (answer at once, where the model's template can), or absent (as the model's template does by default). The budget
  is checked as Anthropic checks it; the thinking is bounded by max_tokens with the answer, not cut at the budget."""
  value = body.get("thinking")
  if value is None:
    return None
  kinds = {"enabled": True, "adaptive": True, "disabled": False}
  if not isinstance(value, dict) or value.get("type") not in kinds:
    raise BadRequest('thinking must be {"type": "enabled", "budget_tokens": ...}, {"type": "adaptive"} or {"type": "disabled"}', param="thinking")
  if value["type"] == "enabled":
    budget, max_tokens = value.get("budget_tokens"), body.get("max_tokens")
    if not is_int(budget) or budget < 1024 or (is_int(max_tokens) and budget >= max_tokens):
      raise BadRequest("thinking.budget_tokens must be an integer of at least 1024, below max_tokens", param="thinking.budget_tokens")
  return kinds[value["type"]]


def _parse(body: dict, default_model: str, engine_classname: str, implemented) -> Dict[str, Any]:
  """The GenerationRequest's fields that a message and a token count share."""
  refuse_unimplemented(body, implemented, NEUTRAL_VALUES)
  model = resolve_model(body.get("model"), default_model, engine_classname, FALLBACK_PREFIXES)
  messages = parse_conversation(body)
  choice, name, parallel = _tool_choice(body)
  tools = parse_tools(body, _custom_tool, '{"name": ..., "input_schema": {...}}', "tools[{i}].name")
  return {"model": model, "messages": messages, "tool_use": tool_use(tools, choice, name, parallel), "response_format": _output_format(body),
          "thinking": _thinking(body), "fields": FieldNames(thinking="thinking")}


def parse_messages_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  common = _parse(body, default_model, engine_classname, IMPLEMENTED)
  max_tokens = body.get("max_tokens")
  if not is_int(max_tokens) or not 1 <= max_tokens <= MAX_INT32:
    raise BadRequest(f"max_tokens is required: an integer >= 1 (and at most {MAX_INT32})", param="max_tokens")
  metadata = body.get("metadata")
  if metadata is not None and not isinstance(metadata, dict):
    raise BadRequest('metadata must be an object such as {"user_id": ...}', param="metadata")
  params = sampling_params({k: body.get(k) for k in ("temperature", "top_p", "top_k", "max_tokens")}, default_temperature, ("max_tokens",),
                           max_temperature=1.0)
  for name in ("user_profile_id", "workspace_id"):
    parse_string(body, name)
  return GenerationRequest(**common, params=params, stop=parse_stop(body, "stop_sequences", MAX_STOP_SEQUENCES), stream=parse_flag(body, "stream"))


def parse_count_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  """count_tokens takes the prompt's fields only (no sampling: `default_temperature` is unused)."""
  return GenerationRequest(**_parse(body, default_model, engine_classname, COUNT_FIELDS))

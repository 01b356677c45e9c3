"""An Anthropic Messages request read into a GenerationRequest: the system prompt and the messages (text,
tool_use and tool_result blocks) as a conversation in the core's form, max_tokens, sampling, stop_sequences, tools
and tool_choice, output_config.format. Bad input is a 400 naming the field; fields this server does not implement
are refused."""
import json
from typing import Annotated, Any, Dict, List, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictStr, model_validator

from exo.api.body_model import MAX_INT32, Body, Closed, Flag, String, Text, checked, integer, invalid, neutral, number, one_of, tagged
from exo.api.chat_request import IMAGE_PLACEHOLDER
from exo.api.errors import BadRequest
from exo.api.generation_request import FieldNames, GenerationRequest
from exo.api.request_fields import TopK, is_int, resolve_model, sampling_params, stop_strings
from exo.api.structured import format_of
from exo.api.tools import Function, distinct, tool_list, tool_use

# Clients name Anthropic's models by habit (Claude Code asks for claude-* models): those mean the default model.
FALLBACK_PREFIXES = ("claude-",)
TOOL_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
THINKING = {"enabled": True, "adaptive": True, "disabled": False}


class ToolChoice(BaseModel):
  """{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}"""
  type: Literal[tuple(TOOL_CHOICES)]
  name: Text = None
  disable_parallel_tool_use: Flag = None


class Thinking(BaseModel):
  type: Literal[tuple(THINKING)]
  budget_tokens: Any = None


class OutputFormat(BaseModel):
  type: Literal["json_schema"]
  json_schema: Any = Field(alias="schema")


class OutputConfig(Closed):
  format: checked(OutputFormat, 'must be {"type": "json_schema", "schema": {...}}') = None
  effort: one_of((), "this model does not reason (leave effort out)", "unsupported_parameter") = None


class Block(BaseModel):
  """A content block; its fields left out are checked as null (a required one fails naming itself)."""
  model_config = ConfigDict(validate_default=True)
  type: str


class TextBlock(Block):
  text: String = None


class MediaBlock(Block):  # an image or a document: a text-only model is told that one was there
  pass


class ToolUseBlock(Block):
  id: StrictStr
  name: StrictStr
  input: Dict[str, Any] = {}


class ThinkingBlock(Block):
  pass


def _one_text_block(content: Any) -> Any:
  return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _a_block(block: Any) -> Any:
  if not isinstance(block, dict) or not isinstance(block.get("type"), str):
    raise invalid('must be a content block: an object with a "type"')
  return block


def blocks_of(why: str, optional: bool = False, **kinds: Any) -> Any:
  """Content: a string (one text block) or a list of blocks of `kinds` (by their type); another type fails saying `why`."""
  block = Annotated[tagged(kinds, why), BeforeValidator(_a_block)]
  return Annotated[checked(List[block], "must be a string or a list of content blocks", optional=optional), BeforeValidator(_one_text_block)]


PLAIN = {"text": TextBlock, "image": MediaBlock, "document": MediaBlock}


class ToolResultBlock(Block):
  tool_use_id: String = None
  content: blocks_of('must be "text" or "image" here', **PLAIN) = ""
  is_error: Any = None


class UserMessage(BaseModel):
  role: str
  content: blocks_of('must be "text", "image", "document" or "tool_result" in a user message', **PLAIN, tool_result=ToolResultBlock)


class AssistantMessage(BaseModel):
  role: str
  content: blocks_of('must be "text" or "tool_use" in an assistant message', text=TextBlock, thinking=ThinkingBlock, redacted_thinking=ThinkingBlock,
                   tool_use=checked(ToolUseBlock, 'must be {"type": "tool_use", "id": ..., "name": ..., "input": {...}}', optional=False))


MESSAGE_WHY = 'must be an object with "role" ("user" or "assistant") and "content"'
Message = checked(tagged({"user": UserMessage, "assistant": AssistantMessage}, MESSAGE_WHY, key="role", at=""), MESSAGE_WHY, optional=False)


class CustomTool(Function):
  """A tool the client runs: its name, description and input_schema. Anthropic's server tools and built-in client tools are not served."""
  type: one_of(("custom",), ": only custom tools (name, description, input_schema) are served here; Anthropic's server tools and its built-in "
               "client tools are not", "unsupported_parameter") = None
  parameters: Any = Field(None, alias="input_schema")

  @model_validator(mode="before")
  @classmethod
  def _has_a_schema(cls, value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") in (None, "custom") and "input_schema" not in value:
      raise invalid("is required: a JSON Schema of the tool's input object", at=".input_schema")
    return value


class CountBody(Body):
  """The fields a token count takes: the prompt's. cache_control (here and on blocks) is a caching hint: this node
  reuses prompt prefixes by itself."""
  model: Any = None
  messages: checked(Annotated[List[Message], Field(min_length=1)],
                    'is required: a non-empty list of {"role": "user" | "assistant", "content": ...} objects', optional=False) = None
  system: blocks_of('must be "text" or "image" here', optional=True, **PLAIN) = None
  tools: tool_list(CustomTool, '{"name": ..., "input_schema": {...}}') = None
  tool_choice: checked(ToolChoice, 'must be {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": ...} or {"type": "none"}') = None
  output_config: checked(OutputConfig, 'must be an object such as {"format": {"type": "json_schema", "schema": {...}}}') = None
  cache_control: Any = None
  thinking: checked(Thinking, 'must be {"type": "enabled", "budget_tokens": ...}, {"type": "adaptive"} or {"type": "disabled"}') = None
  service_tier: neutral("auto", "standard_only") = None
  speed: neutral("standard") = None


class MessagesBody(CountBody):
  """A message's fields. user_profile_id and workspace_id say whom a request is for, which changes nothing in its answer here."""
  max_tokens: integer(1, f"is required: an integer >= 1 (and at most {MAX_INT32})", optional=False) = None
  stop_sequences: stop_strings(16) = None
  stream: Flag = None
  temperature: number(0.0, 1.0) = None
  top_p: number(0.0, 1.0) = None
  top_k: TopK = None
  metadata: checked(Dict[str, Any], 'must be an object such as {"user_id": ...}') = None
  user_profile_id: Text = None
  workspace_id: Text = None


def _conversation(body: CountBody) -> List[Dict[str, Any]]:
  """`system` and `messages` as the core's conversation (OpenAI chat's form)."""
  system = _plain(body.system or [])
  return [{"role": "system", "content": system}] * bool(system) + [turn for message in body.messages for turn in _turn(message)]


def _plain(blocks: list) -> str:
  """Text and image blocks as the text a text-only model sees."""
  return "\n".join(block.text if block.type == "text" else IMAGE_PLACEHOLDER for block in blocks)


def _turn(message) -> List[Dict[str, Any]]:
  """A user turn: its tool results as `tool` messages (in their order), the rest one user message after them. An
  assistant turn: its text, and its tool_use blocks as OpenAI-style tool_calls; its thinking is left out, as
  Anthropic's API leaves earlier turns' thinking out of the prompt (and reasoning models' templates drop it)."""
  blocks = message.content
  if message.role == "user":
    out = [{"role": "tool", "tool_call_id": block.tool_use_id, "content": "Error: " * bool(block.is_error) + _plain(block.content)}
           for block in blocks if block.type == "tool_result"]
    rest = [block for block in blocks if block.type != "tool_result"]
    return out + [{"role": "user", "content": _plain(rest)}] * bool(rest or not out)
  calls = [{"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}
           for block in blocks if block.type == "tool_use"]
  text = "".join(block.text for block in blocks if block.type == "text")
  return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


def _thinking(body: CountBody) -> Optional[bool]:
  """`thinking`: {"type": "enabled", "budget_tokens"} or {"type": "adaptive"} (think first), {"type": "disabled"}
  (answer at once, where the model's template can), or absent (as the model's template does by default). The budget
  is checked as Anthropic checks it; the thinking is bounded by max_tokens with the answer, not cut at the budget."""
  if body.thinking is None:
    return None
  if body.thinking.type == "enabled":
    budget, max_tokens = body.thinking.budget_tokens, getattr(body, "max_tokens", None)
    if not is_int(budget) or budget < 1024 or (max_tokens is not None and budget >= max_tokens):
      raise BadRequest("thinking.budget_tokens must be an integer of at least 1024, below max_tokens", param="thinking.budget_tokens")
  return THINKING[body.thinking.type]


def _parse(body: CountBody, default_model: str, engine_classname: str) -> Dict[str, Any]:
  """The GenerationRequest's fields that a message and a token count share."""
  model = resolve_model(body.model, default_model, engine_classname, FALLBACK_PREFIXES)
  messages = _conversation(body)
  tools = distinct([tool.tool(f"tools[{i}]", key="input_schema") for i, tool in enumerate(body.tools or [])], "tools[{i}].name")
  choice = body.tool_choice or ToolChoice(type="auto")
  if choice.type == "tool" and choice.name is None:
    raise BadRequest('tool_choice {"type": "tool"} needs the tool\'s "name"', param="tool_choice.name")
  spec = body.output_config and body.output_config.format
  response_format = spec and format_of("json_schema", {"schema": spec.json_schema}, "output_config.format", "output_config.format")
  return {"model": model, "messages": messages, "response_format": response_format,
          "tool_use": tool_use(tools, TOOL_CHOICES[choice.type] if body.tool_choice else None, choice.name, not choice.disable_parallel_tool_use),
          "thinking": _thinking(body), "fields": FieldNames(thinking="thinking")}


def parse_messages_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  message = MessagesBody.read(body)
  params = sampling_params(message, default_temperature)
  return GenerationRequest(**_parse(message, default_model, engine_classname), params=params, stop=message.stop_sequences, stream=message.stream)


def parse_count_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  """count_tokens takes the prompt's fields only (no sampling: `default_temperature` is unused)."""
  return GenerationRequest(**_parse(CountBody.read(body), default_model, engine_classname))

"""An OpenAI Responses request read into a GenerationRequest: `input` (a string, or items: messages,
function_call and function_call_output) after `instructions`, max_output_tokens, temperature, top_p, function tools
and tool_choice, text.format. Nothing is stored here, so what needs a stored response (previous_response_id,
conversation, item references, background) is a 400, as are tools that run on OpenAI's servers."""
from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, StrictStr, model_validator

from exo.api.body_model import Body, Closed, Flag, String, Text, checked, flag, invalid, neutral, number, one_of, tagged
from exo.api.chat_request import IMAGE_PLACEHOLDER
from exo.api.errors import BadRequest
from exo.api.generation_request import FieldNames, GenerationRequest
from exo.api.reasoning import Effort, parse_effort
from exo.api.request_fields import MaxTokens, resolve_model, sampling_params
from exo.api.structured import format_of
from exo.api.tools import Function, distinct, tool_list, tool_use

# What `include` may ask for: encrypted reasoning (Codex asks; nothing is encrypted: a reasoning model's thinking comes as
# plain reasoning_text).
INCLUDABLE = ("reasoning.encrypted_content",)
STATELESS = "this server stores no responses: send the whole conversation in `input`"
TEXT_PARTS = {"input_text", "output_text", "text"}
MESSAGE_ROLES = {"user", "assistant", "system", "developer"}


def _content_text(content: Any) -> str:
  """A message's content (or a call's output) as the text a text-only model sees."""
  if isinstance(content, str):
    return content
  if not isinstance(content, list):
    raise invalid("must be a string or a list of content parts")
  texts = []
  for j, part in enumerate(content):
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS and isinstance(part.get("text"), str):
      texts.append(part["text"])
    elif kind == "refusal" and isinstance(part.get("refusal"), str):
      texts.append(part["refusal"])
    elif kind in ("input_image", "input_file", "input_audio"):
      texts.append(IMAGE_PLACEHOLDER)
    else:
      raise invalid('must be a text part ({"type": "input_text", "text": ...}) or an image or file part', at=f"[{j}]")
  return "\n".join(texts)


class Item(BaseModel):
  """An input item; its fields left out are checked as null (a required one fails naming itself)."""
  model_config = ConfigDict(validate_default=True)
  type: str


class MessageItem(Item):
  role: checked(Literal[tuple(sorted(MESSAGE_ROLES))], f"must be one of {', '.join(sorted(MESSAGE_ROLES))}", optional=False) = None
  content: Annotated[str, PlainValidator(_content_text)] = None


class FunctionCallItem(Item):
  call_id: String = None
  name: String = None
  arguments: String = None


class FunctionCallOutputItem(Item):
  call_id: String = None
  output: Annotated[str, PlainValidator(_content_text)] = None


class ItemReference(Item):
  @model_validator(mode="before")
  @classmethod
  def _needs_a_stored_item(cls, value: Any) -> Any:
    raise invalid(f": an item_reference needs a stored item; {STATELESS}", "unsupported_parameter")


def _an_item(item: Any) -> Any:
  if not isinstance(item, dict):
    raise invalid("must be an input item (an object)")
  return {"type": "message", **item}


def _one_message(value: Any) -> Any:
  return [{"role": "user", "content": value}] if isinstance(value, str) else value


INPUT_ITEMS = {"message": MessageItem, "function_call": FunctionCallItem, "function_call_output": FunctionCallOutputItem,
               "item_reference": ItemReference, "reasoning": Item}
InputItem = Annotated[tagged(INPUT_ITEMS, 'is not served here: input items are messages, "function_call" and "function_call_output"'),
                      BeforeValidator(_an_item)]
InputItems = Annotated[checked(Annotated[List[InputItem], Field(min_length=1)], "is required: a string, or a non-empty list of input items",
                               optional=False), BeforeValidator(_one_message)]  # a string is one user message


class TextSettings(Closed):
  """`text`: the answer's format (a json_schema's fields sit beside its type, unlike chat's response_format)."""
  format: checked(Annotated[Dict[str, Any], Field(strict=True)], 'must be an object such as {"type": "json_object"}') = None
  verbosity: one_of(("medium",), ": only medium is served here", "unsupported_parameter") = None


class ReasoningSettings(Closed):
  """`reasoning`: `summary` is accepted (no summary is written: the thinking itself comes back as reasoning_text)."""
  effort: Effort = None
  summary: Any = None
  generate_summary: Any = None


class FunctionTool(Function):
  type: one_of(("function",), ': only "function" tools are served here; the others (web search, file search, computer use, code interpreter, MCP, '
               "...) run on OpenAI's servers", "unsupported_parameter", optional=False) = None


class FunctionChoice(BaseModel):
  type: Literal["function"]
  name: StrictStr


class ResponsesBody(Body):
  """The Responses API's body (the input and tools are read by the functions below). Nothing is stored here: `store`
  is taken either way, and what needs a stored response is refused."""
  model: Any = None
  previous_response_id: one_of((), f": {STATELESS}", "unsupported_parameter") = None
  conversation: one_of((), f": {STATELESS}", "unsupported_parameter") = None
  include: checked(List[Literal[INCLUDABLE]], f"may only hold {list(INCLUDABLE)} here", "unsupported_parameter") = None
  input: InputItems = None
  instructions: Text = None
  user: Text = None
  safety_identifier: Text = None
  prompt_cache_key: Text = None
  store: Flag = None
  metadata: checked(Dict[str, Any], "must be an object of strings") = None
  temperature: number(0.0, 2.0) = None
  top_p: number(0.0, 1.0) = None
  max_output_tokens: MaxTokens = None
  tools: tool_list(FunctionTool, '{"type": "function", "name": ..., "parameters": {...}}') = None
  tool_choice: checked(Union[Literal["none", "auto", "required"], FunctionChoice],
                       'must be "none", "auto", "required" or {"type": "function", "name": ...}') = None
  parallel_tool_calls: flag(True) = True
  text: checked(TextSettings, 'must be an object such as {"format": {"type": "json_schema", ...}}') = None
  reasoning: checked(ReasoningSettings, 'must be an object such as {"effort": "medium"}') = None
  stream: Flag = None
  truncation: neutral("disabled") = None
  background: neutral(False) = None
  service_tier: neutral("auto", "default") = None
  top_logprobs: neutral(0) = None


@dataclass
class ResponsesRequest:
  generation: GenerationRequest
  echo: Dict[str, Any]  # the request's settings, as the response object repeats them


def _conversation(items: List[Any], instructions: Optional[str]) -> List[Dict[str, Any]]:
  """`instructions` and `input` as the core's conversation (OpenAI chat's form); earlier reasoning is left out, as
  reasoning models' templates drop it."""
  out = [{"role": "system", "content": instructions}] if instructions else []
  for item in items:
    if item.type == "message":
      out.append({"role": "system" if item.role == "developer" else item.role, "content": item.content})
    elif item.type == "function_call":
      call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
      if out and out[-1]["role"] == "assistant":  # the calls of one turn, after its text, are one assistant message
        out[-1].setdefault("tool_calls", []).append(call)
      else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif item.type == "function_call_output":
      out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
  return out


def _tool_use(body: ResponsesBody):
  tools = distinct([tool.tool(f"tools[{i}]", strict=True) for i, tool in enumerate(body.tools or [])], "tools[{i}].name")  # strict unless told
  if isinstance(body.tool_choice, FunctionChoice):
    return tool_use(tools, "function", body.tool_choice.name, body.parallel_tool_calls)
  return tool_use(tools, body.tool_choice, None, body.parallel_tool_calls)


def parse_responses_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> ResponsesRequest:
  request = ResponsesBody.read(body)
  model = resolve_model(request.model, default_model, engine_classname)
  messages = _conversation(request.input, request.instructions)
  params = sampling_params(request, default_temperature, max_tokens=request.max_output_tokens)
  spec = (request.text and request.text.format) or {"type": "text"}
  if not isinstance(spec.get("type"), str):
    raise BadRequest('text.format must be an object such as {"type": "json_object"}', param="text.format")
  # `reasoning.effort` "none" makes a reasoning model answer at once (where its template can), another effort makes it
  # think (a model that does not reason: 400); the degree goes to a template that reads it (gpt-oss's low, medium, high)
  # and otherwise does not change how long it thinks.
  thinking, template_kwargs = parse_effort(request.reasoning and request.reasoning.effort)
  generation = GenerationRequest(model, messages=messages, params=params, tool_use=_tool_use(request),
                                 response_format=format_of(spec["type"], spec, "text.format", "text.format"), thinking=thinking,
                                 template_kwargs=template_kwargs, stream=bool(request.stream),
                                 fields=FieldNames(prompt="input", max_tokens="max_output_tokens", thinking="reasoning.effort"))
  echo = {"instructions": request.instructions, "max_output_tokens": params.max_tokens, "metadata": request.metadata or {},
          "parallel_tool_calls": request.parallel_tool_calls, "temperature": params.temperature, "text": {"format": spec},
          "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [], "top_p": params.top_p, "user": request.user}
  return ResponsesRequest(generation, echo)

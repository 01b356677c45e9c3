"""The tool fields of a chat request, checked: `tools` (functions with JSON Schema parameters), `tool_choice` (none,
auto, required, or one named function), `parallel_tool_calls`, and the conversation's earlier calls (assistant
messages with `tool_calls`, `tool` messages answering them by `tool_call_id`). Each problem is a 400 naming its
field. How calls are written and read for a given model is exo/api/tool_formats.py's business."""
import json
from dataclasses import dataclass, field
from typing import Annotated, Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictStr, field_validator

from exo.api.body_model import Switch, Text, checked, flag, invalid
from exo.api.errors import BadRequest
from exo.api.structured import check_schema

NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Tool:
  name: str
  description: str
  parameters: dict  # JSON Schema of the arguments object
  strict: bool

  def describe(self) -> dict:
    return {"name": self.name, "description": self.description, "parameters": self.parameters}


@dataclass
class ToolUse:
  """What a request allows: `choice` "auto" (a call or a plain reply), "required" (at least one call) or "function"
  (a call of `name`); `parallel` lets one reply hold several calls."""
  tools: List[Tool]
  choice: str
  name: Optional[str] = None
  parallel: bool = True
  callable: List[Tool] = field(init=False)

  def __post_init__(self) -> None:
    self.callable = [t for t in self.tools if self.name is None or t.name == self.name]

  @property
  def forced(self) -> bool:
    return self.choice != "auto"

  @property
  def several(self) -> bool:
    """Whether one reply may hold several calls: parallel_tool_calls, unless one function is named (one call of it)."""
    return self.parallel and self.choice != "function"


class Function(BaseModel):
  """A tool as a request declares it: its name, description, `strict`, and (`parameters`) the JSON Schema of its
  arguments object. A dialect's tool adds its `type`, which is checked first."""
  model_config = ConfigDict(validate_default=True)
  type: Any = None
  name: checked(Annotated[str, Field(strict=True, pattern=NAME)], "must be 1 to 64 letters, digits, underscores or dashes", optional=False) = None
  description: Text = None
  strict: Switch = None
  parameters: Any = None

  def tool(self, where: str, strict: bool = False, key: str = "parameters") -> Tool:
    """The Tool, its schema checked (`where`: its path in the request; `strict`: unless the tool says)."""
    strict = strict if self.strict is None else self.strict
    parameters, at = NO_PARAMETERS if self.parameters is None else self.parameters, f"{where}.{key}"
    check_schema(parameters, at, strict)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
      raise BadRequest(f'{at} must be a JSON Schema of an object ("type": "object")', param=at)
    return Tool(self.name, self.description or "", parameters, strict)


def tool_list(kind: Any, example: str) -> Any:
  """`tools`: a list of at most MAX_TOOLS objects of `kind` (each looks like `example`)."""
  return checked(Annotated[List[checked(kind, f"must be an object {example}", optional=False)], Field(max_length=MAX_TOOLS)],
                 f"must be a list of at most {MAX_TOOLS} tools")


def distinct(tools: List[Tool], name_path: str) -> List[Tool]:
  """`tools`, no two of which may share a name (`name_path`: the path of a tool's name, with `{i}` for its index)."""
  for i, tool in enumerate(tools):
    if tool.name in {t.name for t in tools[:i]}:
      raise BadRequest(f"{name_path.format(i=i)}: two tools are named {tool.name!r}", param=name_path.format(i=i))
  return tools


def earlier_calls(call: Any, example: str) -> Any:
  """An assistant message's `tool_calls`: a list of `call`s (each looks like `example`); see `Calling`."""
  return checked(List[checked(call, f"must be {example}", optional=False)], "must be a list, on an assistant message")


class Calling(BaseModel):
  """A message with `tool_calls` (`earlier_calls`), which only an assistant message may hold; `role` comes first."""

  @field_validator("tool_calls", check_fields=False)
  @classmethod
  def _on_an_assistant_message(cls, calls: Optional[list], info) -> Optional[list]:
    if calls is not None and info.data.get("role") != "assistant":
      raise invalid("must be a list, on an assistant message")
    return calls


class ChatTool(BaseModel):
  """OpenAI chat's tool: {"type": "function", "function": {"name", "description", "parameters", "strict"}}."""
  model_config = ConfigDict(validate_default=True)
  type: checked(Literal["function"], 'must be "function" (the only kind of tool)', optional=False) = None
  function: checked(Function, 'must be an object with a "name"', optional=False) = None


class NamedFunction(BaseModel):
  name: StrictStr


class FunctionChoice(BaseModel):
  type: Literal["function"]
  function: NamedFunction


ChatTools = tool_list(ChatTool, '{"type": "function", "function": {...}}')
ChatToolChoice = checked(Union[Literal["none", "auto", "required"], FunctionChoice],
                         'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def tool_use(tools: List[Tool], choice: Optional[str], name: Optional[str], parallel: bool, param: str = "tool_choice") -> Optional[ToolUse]:
  """What the request allows (`choice`: None or "auto", "required", "function" with `name`, "none"); None when no
  tool may be called. BadRequest naming `param` for a choice the tools cannot meet."""
  if choice == "function" and name not in {t.name for t in tools}:
    raise BadRequest(f"{param} names the function {name!r}, which is not among the tools", param=param)
  if choice == "required" and not tools:
    raise BadRequest(f'{param} "required" needs tools', param=param)
  if not tools or choice == "none":
    return None
  return ToolUse(tools, choice or "auto", name, parallel)


class ChatToolFields(BaseModel):
  """The tool fields of an OpenAI chat body."""
  tools: ChatTools = None
  tool_choice: ChatToolChoice = None
  parallel_tool_calls: flag(True) = True

  def tool_use(self) -> Optional[ToolUse]:
    return chat_tool_use(self.tools, self.tool_choice, self.parallel_tool_calls)


def chat_tool_use(tools: Optional[List[ChatTool]], choice: Any = None, parallel: bool = True) -> Optional[ToolUse]:
  """What an OpenAI chat request allows (its `ChatTools` and `ChatToolChoice`), or None when no tool may be called."""
  defined = distinct([tool.function.tool(f"tools[{i}].function") for i, tool in enumerate(tools or [])], "tools[{i}].function.name")
  if isinstance(choice, FunctionChoice):
    return tool_use(defined, "function", choice.function.name, parallel)
  return tool_use(defined, choice, None, parallel)


def arguments_object(arguments: str) -> Any:
  """A call's arguments as chat templates expect them (an object), or the text as it is when it is not JSON."""
  try:
    return json.loads(arguments) if arguments else {}
  except ValueError:
    return arguments

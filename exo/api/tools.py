"""The tool fields of a chat request, checked: `tools` (functions with JSON Schema parameters), `tool_choice` (none,
auto, required, or one named function), `parallel_tool_calls`, and the conversation's earlier calls (assistant
messages with `tool_calls`, `tool` messages answering them by `tool_call_id`). Each problem is a 400 naming its
field. How calls are written and read for a given model is exo/api/tool_formats.py's business."""
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from exo.api.errors import BadRequest
from exo.api.structured import check_schema

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
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


def tool_of(item: dict, where: str, parameters_key: str = "parameters") -> Tool:
  """A tool from its fields `name`, `description`, `strict` and its parameters' schema under `parameters_key`;
  `where` is the request's path to them (errors name their fields under it)."""
  name = item.get("name")
  if not isinstance(name, str) or not NAME.match(name):
    raise BadRequest(f"{where}.name must be 1 to 64 letters, digits, underscores or dashes", param=f"{where}.name")
  description = item.get("description")
  if description is not None and not isinstance(description, str):
    raise BadRequest(f"{where}.description must be a string", param=f"{where}.description")
  strict = item.get("strict")
  if strict is not None and not isinstance(strict, bool):
    raise BadRequest(f"{where}.strict must be true or false", param=f"{where}.strict")
  parameters = item.get(parameters_key)
  parameters = NO_PARAMETERS if parameters is None else parameters
  at = f"{where}.{parameters_key}"
  check_schema(parameters, at, bool(strict))
  if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
    raise BadRequest(f'{at} must be a JSON Schema of an object ("type": "object")', param=at)
  return Tool(name, description or "", parameters, bool(strict))


def parse_tools(body: dict, read: Callable[[dict, str], Tool], example: str, name_path: str) -> List[Tool]:
  """`tools`, each item (an object) made a Tool by `read(item, where)`; `example` is what an item looks like,
  `name_path` the path of a tool's name with `{i}` for its index (two tools may not share a name)."""
  value = body.get("tools")
  if value is None:
    return []
  if not isinstance(value, list) or len(value) > MAX_TOOLS:
    raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} tools", param="tools")
  tools, seen = [], set()
  for i, item in enumerate(value):
    where = f"tools[{i}]"
    if not isinstance(item, dict):
      raise BadRequest(f"{where} must be an object {example}", param=where)
    tools.append(read(item, where))
    if tools[-1].name in seen:
      at = name_path.format(i=i)
      raise BadRequest(f"{at}: two tools are named {tools[-1].name!r}", param=at)
    seen.add(tools[-1].name)
  return tools


def _function_tool(item: dict, where: str) -> Tool:
  if item.get("type") != "function":
    raise BadRequest(f'{where}.type must be "function" (the only kind of tool), got {item.get("type")!r}', param=f"{where}.type")
  function = item.get("function")
  if not isinstance(function, dict):
    raise BadRequest(f'{where}.function must be an object with a "name"', param=f"{where}.function")
  return tool_of(function, f"{where}.function")


def parse_tool_definitions(body: dict) -> List[Tool]:
  """OpenAI chat's tools: {"type": "function", "function": {"name", "description", "parameters", "strict"}}."""
  return parse_tools(body, _function_tool, '{"type": "function", "function": {...}}', "tools[{i}].function.name")


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


def parse_tool_use(body: dict) -> Optional[ToolUse]:
  """What the request allows, or None when no tool may be called (no tools, or tool_choice "none")."""
  tools = parse_tool_definitions(body)
  choice, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
  if parallel is not None and not isinstance(parallel, bool):
    raise BadRequest("parallel_tool_calls must be true or false", param="parallel_tool_calls")
  name = None
  if isinstance(choice, dict):
    function = choice.get("function")
    if choice.get("type") != "function" or not isinstance(function, dict) or not isinstance(function.get("name"), str):
      raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}', param="tool_choice")
    name, choice = function["name"], "function"
  elif choice is not None and choice not in ("none", "auto", "required"):
    raise BadRequest('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}', param="tool_choice")
  return tool_use(tools, choice, name, True if parallel is None else parallel)


def arguments_object(arguments: str) -> Any:
  """A call's arguments as chat templates expect them (an object), or the text as it is when it is not JSON."""
  try:
    return json.loads(arguments) if arguments else {}
  except ValueError:
    return arguments

"""How a model writes tool calls, one format per family of chat templates, each with three jobs: the conversation as
its template wants it (earlier calls and tool results included), the grammar its answer must follow, and reading
the calls (and any plain text) back out of the answer as it streams.

- hermes (templates that mention `<tool_call>`: Qwen, SmolLM3, Hermes): calls written as
  `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, after optional text; with tool_choice auto only the
  calls are constrained, from the opening marker on (the text before it is free).
- mistral (templates that mention `[TOOL_CALLS]`: Mistral 7B v0.3, Nemo, Small 3.x): after optional text,
  `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, or, where the template has `[ARGS]` (Small 3.2, Magistral,
  Devstral), `[TOOL_CALLS]name[ARGS]{...}` per call; constrained from the marker on, as hermes; call ids of 9 letters
  and digits, as its templates require.
- llama3 (templates with `<|python_tag|>` or the ipython role: Llama 3.x): the whole answer is either text (not
  starting with "{") or one call `{"name": ..., "parameters": {...}}`.
- harmony (gpt-oss's templates, with `<|channel|>`): exo/api/harmony.py.
- generic (any other template, e.g. the embedded SmolLM2's): the tools are described in a system message and the
  answer is one JSON object, `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` or `{"response": "..."}`.

Every format writes JSON in grammar.JSON_LAYOUT, so a call is read as soon as its name is complete and its
arguments stream as they grow."""
import hashlib
import json
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from exo.api.structured import ResponseFormat
from exo.api.tools import Tool, ToolUse, arguments_object
from exo.inference import grammar


@dataclass
class CallText:
  """A call read from the answer so far: its arguments' JSON text as far as it has come."""
  name: str
  arguments: str
  complete: bool


View = Tuple[str, List[CallText]]  # (the answer's plain text so far, the calls so far)
MAX_CALLS = 4  # calls in one reply at most: a small model that may add calls tends to repeat its first one until cut off


# --- reading JSON as it streams ---

def _string_end(text: str, i: int) -> Optional[int]:
  """The index after the string that starts at text[i] (a quote), or None if it has not ended."""
  j = i + 1
  while j < len(text):
    if text[j] == "\\":
      j += 2
      continue
    if text[j] == '"':
      return j + 1
    j += 1
  return None


def json_value_end(text: str, i: int, final: bool) -> Optional[int]:
  """The index after the JSON value that starts at text[i], or None if the text stops inside it."""
  if i >= len(text):
    return None
  if text[i] == '"':
    return _string_end(text, i)
  if text[i] in "{[":
    depth, j = 0, i
    while j < len(text):
      if text[j] == '"':
        end = _string_end(text, j)
        if end is None:
          return None
        j = end
        continue
      depth += text[j] in "{["
      depth -= text[j] in "}]"
      j += 1
      if depth == 0:
        return j
    return None
  j = i
  while j < len(text) and text[j] not in ",}] \n\r\t":
    j += 1
  return j if j < len(text) or final else None  # a number at the end may have more digits to come


def json_string_so_far(text: str, i: int) -> str:
  """The decoded characters of the JSON string that starts at text[i], as far as they are certain."""
  end = _string_end(text, i)
  raw = text[i + 1:end - 1] if end is not None else text[i + 1:]
  for cut in range(7):  # an escape cut short (at most "\\uXXX") decodes once it is whole
    try:
      return json.loads('"' + raw[:len(raw) - cut] + '"')
    except ValueError:
      continue
  return ""


def _held_back(text: str, marker: str) -> str:
  """`text` less any tail that may be the start of `marker`."""
  for k in range(min(len(marker) - 1, len(text)), 0, -1):
    if text.endswith(marker[:k]):
      return text[:-k]
  return text


def read_call(text: str, pos: int, key: str, final: bool) -> Tuple[Optional[CallText], int]:
  """The call `{"name": "N", "<key>": ARGS}` at text[pos] (None until its name is whole), and where it ends."""
  head = '{"name": "'
  if not text.startswith(head, pos):
    return None, pos
  name_end = text.find('"', pos + len(head))
  if name_end < 0:
    return None, pos
  name = text[pos + len(head):name_end]
  between = f'", "{key}": '
  start = name_end + len(between)
  if not text.startswith(between, name_end):
    return (CallText(name, "", False) if between.startswith(text[name_end:]) else None), len(text)
  end = json_value_end(text, start, final)
  if end is None:
    return CallText(name, text[start:], False), len(text)
  return CallText(name, text[start:end], True), end + (text.startswith("}", end))


# --- the formats ---

def rebased(schema: Any, base: str) -> Any:
  """A copy of `schema` to be placed at JSON pointer `base` inside another: its local `$ref`s ("#/$defs/X", "#")
  point where its parts now are."""
  if isinstance(schema, list):
    return [rebased(s, base) for s in schema]
  if not isinstance(schema, dict):
    return schema
  return {k: ("#" + base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebased(v, base)) for k, v in schema.items()}


def _one_call_schema(tool: Tool, key: str, base: str) -> dict:
  """A call of `tool` as a JSON object, to be placed at `base` ("" for the root)."""
  return {"type": "object", "properties": {"name": {"const": tool.name}, key: rebased(tool.parameters, f"{base}/properties/{key}")},
          "required": ["name", key], "additionalProperties": False}


def call_schemas(use: ToolUse, key: str, first: int = 0) -> List[dict]:
  """Each callable tool's call schema, as alternatives of one anyOf starting at index `first`."""
  if len(use.callable) == 1 and first == 0:
    return [_one_call_schema(use.callable[0], key, "")]
  return [_one_call_schema(t, key, f"/anyOf/{first + i}") for i, t in enumerate(use.callable)]


def call_fragment(use: ToolUse, key: str) -> str:
  """%json of one call of any callable tool, the arguments under `key`."""
  schemas = call_schemas(use, key)
  lenient = not all(t.strict for t in use.callable)
  return grammar.json_fragment(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}, lenient=lenient)


class ToolFormat:
  name = ""
  key = "arguments"  # where a call's arguments go

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer

  def conversation(self, messages: List[Dict[str, Any]], use: Optional[ToolUse]) -> Tuple[List[Dict[str, Any]], Optional[List[dict]]]:
    """(messages, tools) for the chat template: earlier calls' arguments as objects, as templates expect them."""
    out = []
    for message in messages:
      if message.get("tool_calls"):
        calls = [{**call, "function": {**call["function"], "arguments": arguments_object(call["function"].get("arguments", ""))}} for call in message["tool_calls"]]
        message = {**message, "tool_calls": calls}
      out.append(message)
    return out, ([{"type": "function", "function": t.describe()} for t in use.tools] if use else None)

  def new_id(self) -> str:
    """An id for a call the model made."""
    return f"call_{uuid.uuid4().hex[:24]}"

  def grammar(self, use: ToolUse, reply: Optional[ResponseFormat]) -> str:
    """Lark text the answer must follow; `reply` is the format of a plain reply (None: free text)."""
    raise NotImplementedError

  def view(self, text: str, final: bool) -> View:
    raise NotImplementedError


class MarkerFormat(ToolFormat):
  """Calls that follow a marker the model writes (`<tool_call>`, `[TOOL_CALLS]`), after optional text; with tool_choice
  auto only what follows the marker is constrained. Subclasses give the rule `calls` (what follows the first marker)
  and read the calls back (`read_calls`)."""
  OPEN = ""

  def calls_rules(self, use: ToolUse, opening: str) -> List[str]:
    raise NotImplementedError

  def grammar(self, use: ToolUse, reply: Optional[ResponseFormat]) -> str:
    opening = grammar.marker(self.tokenizer, self.OPEN)
    lines = self.calls_rules(use, opening)
    if use.forced:
      lines.insert(0, f"start: {opening} calls")
    elif reply is not None:
      lines.insert(0, f"start: answer | {opening} calls")
      lines.append(f"answer: {reply.fragment()}")
    elif opening == grammar.lark_string(self.OPEN):  # plain text up to the marker: the lazy rule ends at its first occurrence
      lines.insert(0, "start: TEXT | text_then_marker calls")
      lines.append(f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{grammar.regex_literal(self.OPEN)}(.|\\n)*/")
      lines.append(f"text_then_marker[lazy]: /(.|\\n)*{grammar.regex_literal(self.OPEN)}/")
    else:
      lines.insert(0, f"start: TEXT? | TEXT? {opening} calls")
      lines.append("TEXT: /(.|\\n)+/")
    return "\n".join(lines)

  def view(self, text: str, final: bool) -> View:
    start = text.find(self.OPEN)
    if start < 0:
      return (text if final else _held_back(text, self.OPEN)), []
    return text[:start], self.read_calls(text, start + len(self.OPEN), final)

  def read_calls(self, text: str, pos: int, final: bool) -> List[CallText]:
    """The calls written from text[pos] on (just after the first marker)."""
    raise NotImplementedError


def _listed_calls(text: str, pos: int, key: str, separator: str, final: bool) -> List[CallText]:
  """Calls `{"name": ..., key: ...}` from text[pos] on, one after another with `separator` between them."""
  calls = []
  while True:
    call, pos = read_call(text, pos, key, final)
    if call is None:
      return calls
    calls.append(call)
    if not call.complete or not text.startswith(separator, pos):
      return calls
    pos += len(separator)


class HermesFormat(MarkerFormat):
  name = "hermes"
  OPEN, CLOSE = "<tool_call>", "</tool_call>"

  def calls_rules(self, use, opening):
    more = f' ("\\n" {opening} call){{0,{MAX_CALLS - 1}}}' if use.several else ""
    return [f"calls: call{more}", f'call: "\\n" {call_fragment(use, self.key)} "\\n" {grammar.marker(self.tokenizer, self.CLOSE)}']

  def read_calls(self, text, pos, final):
    return _listed_calls(text, pos + 1, self.key, f"\n{self.CLOSE}\n{self.OPEN}\n", final)


class MistralFormat(MarkerFormat):
  """Mistral's (7B v0.3, Nemo, Small 3.x): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`. Its templates take
  only call ids of 9 letters and digits, so those are the ids it gives, and other ids are mapped to such."""
  name = "mistral"
  OPEN = "[TOOL_CALLS]"
  LIST = " ["

  def new_id(self) -> str:
    return "".join(random.choices(ALPHANUMERIC, k=9))

  def conversation(self, messages, use):
    messages, tools = super().conversation(messages, use)
    out = []
    for message in messages:
      if message.get("tool_calls"):
        message = {**message, "tool_calls": [{**call, "id": mistral_id(call.get("id"))} for call in message["tool_calls"]]}
      if message["role"] == "tool" and "tool_call_id" in message:
        message = {**message, "tool_call_id": mistral_id(message["tool_call_id"])}
      out.append(message)
    return out, tools

  def calls_rules(self, use, opening):
    more = f' (", " call){{0,{MAX_CALLS - 1}}}' if use.several else ""
    return [f'calls: {grammar.lark_string(self.LIST)} call{more} "]"', f"call: {call_fragment(use, self.key)}"]

  def read_calls(self, text, pos, final):
    return _listed_calls(text, pos + len(self.LIST), self.key, ", ", final) if text.startswith(self.LIST, pos) else []


class MistralArgsFormat(MistralFormat):
  """Mistral's newer one (Small 3.2, Magistral, Devstral; templates with `[ARGS]`): each call
  `[TOOL_CALLS]name[ARGS]{...}`."""
  name = "mistral-args"
  ARGS = "[ARGS]"

  def calls_rules(self, use, opening):
    more = f" ({opening} call){{0,{MAX_CALLS - 1}}}" if use.several else ""
    args = grammar.marker(self.tokenizer, self.ARGS)
    lenient = not all(t.strict for t in use.callable)
    alternatives = " | ".join(f"{grammar.lark_string(t.name)} {args} {grammar.json_fragment(t.parameters, lenient=lenient)}" for t in use.callable)
    return [f"calls: call{more}", f"call: {alternatives}"]

  def read_calls(self, text, pos, final):
    calls = []
    while True:
      name_end = text.find(self.ARGS, pos)
      if name_end < 0:
        return calls
      start = name_end + len(self.ARGS)
      end = json_value_end(text, start, final)
      calls.append(CallText(text[pos:name_end], text[start:end] if end is not None else text[start:], end is not None))
      if end is None or not text.startswith(self.OPEN, end):
        return calls
      pos = end + len(self.OPEN)


ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_id(call_id: Optional[str]) -> str:
  """A call id as Mistral's templates take it (9 letters and digits): kept if it is one, else one made from it, the
  same each time (a call and the result that answers it keep matching)."""
  if call_id and re.fullmatch(r"[a-zA-Z0-9]{9}", call_id):
    return call_id
  number = int.from_bytes(hashlib.sha256((call_id or "").encode()).digest()[:8], "big")
  return "".join(ALPHANUMERIC[(number // 62 ** i) % 62] for i in range(9))


class Llama3Format(ToolFormat):
  name = "llama3"
  key = "parameters"

  def conversation(self, messages, use):
    messages, tools = super().conversation(messages, use)
    # Llama's templates read a call's arguments from `parameters` (newer ones from `arguments`): give both.
    for message in messages:
      for call in message.get("tool_calls") or []:
        call["function"].setdefault("parameters", call["function"]["arguments"])
    return messages, tools

  def grammar(self, use: ToolUse, reply: Optional[ResponseFormat]) -> str:
    if use.forced:
      return f"start: {call_fragment(use, self.key)}"
    if reply is not None:  # both are JSON objects: one %json whose anyOf holds the reply's schema beside the calls'
      schemas = [rebased(reply.schema, "/anyOf/0")] + call_schemas(use, self.key, first=1)
      return "start: " + grammar.json_fragment({"anyOf": schemas}, lenient=not reply.strict or not all(t.strict for t in use.callable))
    return f"start: TEXT | call\nTEXT: /([^{{](.|\\n)*)?/\ncall: {call_fragment(use, self.key)}"

  def view(self, text: str, final: bool) -> View:
    if not text.startswith("{"):
      return text, []
    call, _ = read_call(text, 0, self.key, final)
    if call is None and not '{"name": "'.startswith(text[:10]):
      return text, []  # a JSON reply (response_format), not a call
    return "", [call] if call is not None else []


GENERIC_CALLS, GENERIC_REPLY = '{"tool_calls": [', '{"response": '


class GenericFormat(ToolFormat):
  name = "generic"

  def __init__(self, tokenizer, structured_reply: bool = False):
    super().__init__(tokenizer)
    self.structured_reply = structured_reply  # the reply is JSON of its own (response_format), not a string

  def conversation(self, messages, use):
    out = [self._system(messages[0] if messages and messages[0]["role"] == "system" else None, use)] if use else []
    names = {}
    for message in messages:
      if use and message is messages[0] and message["role"] == "system":
        continue
      if message.get("tool_calls"):
        calls = [{"name": c["function"]["name"], "arguments": arguments_object(c["function"].get("arguments", ""))} for c in message["tool_calls"]]
        names.update({c.get("id"): c["function"]["name"] for c in message["tool_calls"]})
        message = {"role": "assistant", "content": json.dumps({"tool_calls": calls})}
      elif message["role"] == "tool":
        name = names.get(message.get("tool_call_id"))
        message = {"role": "user", "content": f"Result of the call to {name or 'the tool'}:\n{message['content']}"}
      elif message["role"] == "assistant" and use:
        message = {"role": "assistant", "content": json.dumps({"response": message["content"]})}
      out.append(message)
    return out, None

  def _system(self, system: Optional[dict], use: ToolUse) -> dict:
    tools = "\n".join(json.dumps(t.describe()) for t in use.tools)
    if use.choice == "function":
      rule = f'You must call the tool "{use.name}".'
    elif use.choice == "required":
      rule = "You must call one of the tools."
    else:
      rule = 'If a tool can help, call it; otherwise answer with {"response": "<your answer>"}.'
    calls = f"one to {MAX_CALLS} calls" if use.several else "exactly one call"
    text = (f"You can call these tools:\n{tools}\n\nAnswer with one JSON object. To call tools: "
            f'{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}} with {calls}. {rule}')
    return {"role": "system", "content": f"{system['content']}\n\n{text}" if system else text}

  def grammar(self, use: ToolUse, reply: Optional[ResponseFormat]) -> str:
    more = f' (", " call){{0,{MAX_CALLS - 1}}}' if use.several else ""
    lines = [f'calls: {grammar.lark_string(GENERIC_CALLS)} call{more} "]}}"', f"call: {call_fragment(use, self.key)}"]
    if use.forced:
      return "\n".join(["start: calls"] + lines)
    answer = reply.fragment() if reply is not None else grammar.json_fragment({"type": "string"})
    return "\n".join(["start: calls | reply", f'reply: {grammar.lark_string(GENERIC_REPLY)} answer "}}"', f"answer: {answer}"] + lines)

  def view(self, text: str, final: bool) -> View:
    if text.startswith(GENERIC_REPLY):
      start = len(GENERIC_REPLY)
      if self.structured_reply:
        end = json_value_end(text, start, final)
        return text[start:end] if end is not None else text[start:], []
      return (json_string_so_far(text, start) if text[start:start + 1] == '"' else ""), []
    if not text.startswith(GENERIC_CALLS):
      return "", []
    calls, pos = [], len(GENERIC_CALLS)
    while True:
      call, pos = read_call(text, pos, self.key, final)
      if call is None:
        break
      calls.append(call)
      if not call.complete or not text.startswith(", ", pos):
        break
      pos += 2
    return "", calls


def format_for(tokenizer, structured_reply: bool = False) -> ToolFormat:
  """The model's own tool format, read from its chat template; the generic one when it has none."""
  from exo.api.harmony import HarmonyFormat, writes_harmony  # (harmony builds on this module)
  template = getattr(tokenizer, "chat_template", None) or ""
  if writes_harmony(tokenizer):
    return HarmonyFormat(tokenizer)
  if "<tool_call>" in template:
    return HermesFormat(tokenizer)
  if "[TOOL_CALLS]" in template:
    return MistralArgsFormat(tokenizer) if "[ARGS]" in template else MistralFormat(tokenizer)
  if "<|python_tag|>" in template or "ipython" in template:
    return Llama3Format(tokenizer)
  return GenericFormat(tokenizer, structured_reply)


class ToolCallStream:
  """One choice's answer read as it streams: each piece of text in, the new plain text and OpenAI's tool-call deltas
  out (a call's index, id, type and name once, then its arguments in fragments)."""

  def __init__(self, tool_format: ToolFormat):
    self.format = tool_format
    self.text = ""
    self.content = ""  # plain text sent so far
    self.calls: List[CallText] = []  # calls as far as they were sent
    self.ids: List[str] = []

  def feed(self, text: str, final: bool) -> Tuple[str, List[dict]]:
    self.text += text
    content, calls = self.format.view(self.text, final)
    new_content = content[len(self.content):] if content.startswith(self.content) else ""
    self.content += new_content
    deltas = []
    for k, call in enumerate(calls):
      if k == len(self.calls):
        self.ids.append(self.format.new_id())
        self.calls.append(call)
        deltas.append({"index": k, "id": self.ids[k], "type": "function", "function": {"name": call.name, "arguments": call.arguments}})
        continue
      sent = self.calls[k].arguments
      if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
        deltas.append({"index": k, "function": {"arguments": call.arguments[len(sent):]}})
        self.calls[k] = call
    return new_content, deltas

  def tool_calls(self) -> List[dict]:
    return [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for i, c in zip(self.ids, self.calls)]

  def final_content(self) -> Optional[str]:
    """The reply's plain text; null when it is calls only (OpenAI's shape)."""
    return (self.content.strip() or None) if self.calls else self.content

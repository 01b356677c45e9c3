"""What answer a chat request asks for, once its model's tokenizer is known: the conversation as the chat template
gets it, the grammar the answer must follow (compiled here, before the request is admitted, so a schema the grammar
engine cannot do is a 400), and the tool format its calls are read back in."""
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from exo.api.errors import BadRequest
from exo.api.reasoning import Reasoning, ReasoningSplit
from exo.api.structured import ResponseFormat
from exo.api.tool_formats import ToolCallStream, ToolFormat, format_for
from exo.api.tools import ToolUse
from exo.inference import grammar


@dataclass
class AnswerPlan:
  messages: List[Dict[str, Any]]
  tools: Optional[List[dict]]  # for the chat template
  grammar: Optional[str]  # Lark text (see exo/inference/grammar.py), None when the answer is free
  tool_format: Optional[ToolFormat]  # None when no tool may be called
  bounded_numbers: bool = True  # no schema asks for numbers wider than the grammar's bounds (grammar.asks_for_wide_numbers)
  reasoning: Optional[Reasoning] = None  # how the model thinks, when it does and the answer is a conversation's
  thinking_opened: bool = False  # the prompt left a thinking block open: the answer starts inside it

  def tool_stream(self) -> Optional[ToolCallStream]:
    return ToolCallStream(self.tool_format) if self.tool_format is not None else None

  def think_first(self, tokenizer, reasoning: Optional[Reasoning], prompt: str) -> None:
    """For a reasoning model (its templated `prompt` given): the answer is read apart from its thinking, and its
    grammar, if it has one, holds from the end of the thinking on."""
    if reasoning is None:
      return
    self.reasoning, self.thinking_opened = reasoning, reasoning.opened_by(prompt)
    if self.grammar is not None:
      field = "tools" if self.tool_format is not None else "response_format"
      self.grammar = _compiled(tokenizer, reasoning.grammar_after(self.grammar, self.thinking_opened, tokenizer, self.tool_format is not None), field)

  def reasoning_split(self) -> Optional[ReasoningSplit]:
    return self.reasoning.split(self.thinking_opened, self.tool_format is not None) if self.reasoning is not None else None

  def completed_by(self, tokenizer) -> Optional[Callable[[Sequence[int]], bool]]:
    """Whether an answer's tokens complete its grammar (it then ends without an end token, and that is a "stop")."""
    if self.grammar is None:
      return None
    source = self.grammar

    def complete(tokens: Sequence[int]) -> bool:
      matcher = grammar.compile_matcher(tokenizer, source)  # cached: a copy of the matcher compiled at admission
      return matcher.consume_tokens([int(t) for t in tokens]) and matcher.is_stopped()
    return complete


def plan_answer(tokenizer, messages: List[Dict[str, Any]], response_format: Optional[ResponseFormat], tool_use: Optional[ToolUse]) -> AnswerPlan:
  """Run on the prompt threads: compiling a grammar takes milliseconds (a first one per model, ~0.5 s more for the
  vocabulary). A request that may call no tool shows the chat template none (tool_choice none means no call)."""
  schemas = ([response_format.schema] if response_format is not None else []) + ([t.parameters for t in tool_use.callable] if tool_use else [])
  bounded = not grammar.asks_for_wide_numbers(schemas)
  if tool_use is None:
    source = f"start: {response_format.fragment()}" if response_format is not None else None
    return AnswerPlan(messages, None, _compiled(tokenizer, source, "response_format"), None, bounded)
  tool_format = format_for(tokenizer, structured_reply=response_format is not None)
  messages, tools = tool_format.conversation(messages, tool_use)
  source = tool_format.grammar(tool_use, response_format)
  return AnswerPlan(messages, tools, _compiled(tokenizer, source, "tools"), tool_format, bounded)


def _compiled(tokenizer, source: Optional[str], field: str) -> Optional[str]:
  if source is None:
    return None
  try:
    grammar.compile_matcher(tokenizer, source)
  except grammar.CannotConstrain as e:
    raise BadRequest(f"{field}: this model's output cannot be constrained here ({e})", param=field, code="unsupported_parameter") from None
  except grammar.GrammarError as e:
    raise BadRequest(f"{field} cannot be enforced on this model: {e}", param=field, code="unsupported_schema") from None
  return source

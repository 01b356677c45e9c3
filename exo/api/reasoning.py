"""A reasoning model's thinking, read apart from its answer. Models such as Qwen3, QwQ and the DeepSeek-R1 distills
write their thinking between `<think>` and `</think>` before the answer; the chat template may open `<think>` itself
at the end of the prompt (the R1 distills, Qwen3's thinking-only releases), or leave it to the model (Qwen3).

Whether a model reasons is read from its chat template, never guessed from its output: the template mentions the
closing tag (every reasoning model's template does, to take earlier turns' thinking out of the prompt). A tokenizer
with the tags among its tokens is not enough: Qwen's non-thinking releases share their tokenizer with the thinking
ones. Where the template reads `enable_thinking` (Qwen3's do), a request can turn thinking off.

gpt-oss thinks in harmony's analysis channel instead (exo/api/harmony.py); its template says so too, and the same
Reasoning reads it, with harmony's split and grammar."""
from dataclasses import dataclass
from typing import Optional, Tuple

from exo.api.body_model import one_of
from exo.api.errors import BadRequest
from exo.api.harmony import HarmonySplit, grammar_after_analysis, writes_harmony
from exo.api.reply_text import marker_tail
from exo.inference import grammar

OPEN, CLOSE = "<think>", "</think>"
SWITCH = "enable_thinking"  # the template variable Qwen3's templates (and vLLM's chat_template_kwargs) turn thinking on and off with
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning efforts
EFFORT = "reasoning_effort"  # the template variable gpt-oss's templates read the degree of thinking from (low, medium, high)


@dataclass(frozen=True)
class Reasoning:
  """How a model reasons: whether its template can turn thinking off, and whether it thinks in harmony's channels
  (gpt-oss) rather than between `<think>` tags."""
  switchable: bool
  harmony: bool = False

  @staticmethod
  def opened_by(prompt: str) -> bool:
    """Whether the templated prompt leaves a thinking block open, so the answer starts inside it (a harmony prompt
    ends at `<|start|>assistant`: never)."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)

  def split(self, opened: bool, with_calls: bool):
    """A reader of one choice's reply into thinking and answer (ReasoningSplit's feed); `with_calls`: the request
    offers tools, whose calls go on in the answer for its tool format to read."""
    return HarmonySplit(with_calls) if self.harmony else ReasoningSplit(opened)

  def grammar_after(self, source: str, opened: bool, tokenizer, answer_headed: bool) -> str:
    """The answer's grammar with the thinking before it (see grammar_after_thinking); `answer_headed`: the grammar
    writes harmony's message headers itself (a harmony tool format's)."""
    if self.harmony:
      return grammar_after_analysis(source, tokenizer, answer_headed)
    return grammar_after_thinking(source, opened, tokenizer)


def reasoning_of(tokenizer) -> Optional[Reasoning]:
  """The model's way of reasoning, or None for a model that does not."""
  template = getattr(tokenizer, "chat_template", None) or ""
  if writes_harmony(tokenizer):
    return Reasoning(switchable=False, harmony=True)
  if CLOSE in template:
    return Reasoning(switchable=SWITCH in template)
  return None


class ReasoningSplit:
  """One choice's text read as it streams: each piece in, (new thinking, new answer text) out.

  The answer starts inside the thinking when the prompt opened it; otherwise it is thinking only if the model's
  first words are `<think>` (text that may still become the tag is held back until it shows whether it is). The
  tags are no one's text; the whitespace around them (templates write `</think>\\n\\n`) belongs to neither part.
  Thinking that never closes (the budget ran out) is all thinking, as vLLM and llama.cpp read it."""

  def __init__(self, opened: bool):
    self.state = "thinking" if opened else "start"
    self.pending = ""  # text not yet given to either part
    self.started = False  # the current part has had a non-blank character

  def feed(self, text: str, final: bool) -> Tuple[str, str]:
    self.pending += text
    thinking, answer = "", ""
    if self.state == "start":
      head = self.pending.lstrip()
      if head.startswith(OPEN):
        self.pending, self.state = head[len(OPEN):], "thinking"
      elif final or not OPEN.startswith(head):
        self.state, self.started = "answer", False
      else:
        return "", ""
    if self.state == "thinking":
      end = self.pending.find(CLOSE)
      if end < 0:
        keep = 0 if final else marker_tail(self.pending, [CLOSE])
        body, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
        return self._part(body, final), ""
      thinking = self._part(self.pending[:end], True)
      self.pending, self.state, self.started = self.pending[end + len(CLOSE):], "answer", False
    if self.state == "answer":
      answer, self.pending = self._lead_trimmed(self.pending), ""
    return thinking, answer

  def _lead_trimmed(self, text: str) -> str:
    """`text` less the blanks that open the current part."""
    if not self.started:
      text = text.lstrip()
      self.started = bool(text)
    return text

  def _part(self, body: str, whole: bool) -> str:
    """Thinking text to send: leading blanks dropped, trailing blanks held back until more text follows them
    (they may be the blanks before the closing tag) unless the thinking is `whole`."""
    body = self._lead_trimmed(body)
    if whole:
      return body.rstrip()
    sent = body.rstrip()
    self.pending = body[len(sent):] + self.pending
    return sent


Effort = one_of(EFFORTS, f"must be one of {', '.join(EFFORTS)}")  # a body's field that takes one


def parse_effort(effort: Optional[str]) -> Tuple[Optional[bool], dict]:
  """An OpenAI reasoning effort (an `Effort`): whether to think ("none": not, where the template can), and the
  template's variables: the degree as `reasoning_effort` where it is one gpt-oss's templates know, as vLLM passes it
  (other templates do not read it)."""
  if effort is None:
    return None, {}
  return effort != "none", ({EFFORT: effort} if effort in ("low", "medium", "high") else {})


def template_switches(reasoning: Optional[Reasoning], thinking: Optional[bool], extra: dict, refuse_field: Optional[str]) -> dict:
  """The chat template's extra variables: the request's own, and `enable_thinking` when the request says whether to
  think (a template that does not read it renders as before). Asking a model that does not reason to think is a 400
  where the dialect refuses it (`refuse_field`: Ollama's think, Anthropic's thinking); vLLM's chat_template_kwargs
  only pass variables to the template."""
  if thinking and reasoning is None and refuse_field is not None:
    raise BadRequest(f"{refuse_field}: this model does not think (its chat template has no {CLOSE} tags)", param=refuse_field,
                     code="unsupported_parameter")
  return {**extra, SWITCH: thinking} if thinking is not None else dict(extra)


def grammar_after_thinking(source: str, opened: bool, tokenizer) -> str:
  """The answer's grammar (Lark text whose first rule is `start`) with the thinking before it: free text up to the
  closing tag (the block the prompt opened, or one the model may open first), its blank lines, then the answer as
  the grammar asks. So a reasoning model thinks before a constrained answer, as vLLM lets it, and the answer, never
  the thinking, is what the grammar holds to."""
  if not source.startswith("start:"):
    raise ValueError("the grammar's first rule must be start")
  close = grammar.marker(tokenizer, CLOSE)
  if close.startswith('"'):  # text: the thinking ends at the tag's first occurrence
    thought, rules = "thought", [f"thought[lazy]: /(.|\\n)*{grammar.regex_literal(CLOSE)}/"]
  else:  # a special token, which no text matches
    thought, rules = f"THOUGHT? {close}", ["THOUGHT: /(.|\\n)+/"]
  block = thought if opened else f"({grammar.marker(tokenizer, OPEN)} {thought})?"
  return "\n".join([f'start: {block} ("\\n" | "\\n\\n")? after_thinking', "after_thinking:" + source[len("start:"):]] + rules)

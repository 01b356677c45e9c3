"""gpt-oss's "harmony" format: the model writes its answer as messages, each a header (channel, and a recipient when
it calls a tool) and a body, `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...
<|return|>`. The analysis channel is its thinking, the final channel its answer, and a message addressed
`to=functions.NAME` (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}<|call|>`) a tool
call. The markers are special tokens: they structure the reply and are never part of its text.

A model writes harmony when its chat template does (it mentions `<|channel|>`). Here are the reading of a streamed
reply into thinking, answer and calls (HarmonySplit), its tool format (HarmonyFormat) and the grammar that holds a
reply to harmony's shape (the thinking first, then the answer or the call)."""
import re
from typing import Optional, Tuple

from exo.api.reply_text import marker_tail
from exo.api.structured import ResponseFormat
from exo.api.tool_formats import CallText, ToolFormat, View, json_value_end
from exo.api.tools import ToolUse
from exo.inference import grammar

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
FUNCTIONS = "functions."  # the namespace a template puts the request's tools in
_BODY_END = re.compile(r"<\|(?:end|return|call|start)\|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_HEADER_HEADS = (CHANNEL, MESSAGE, CONSTRAIN, "to=", " to=")


def writes_harmony(tokenizer) -> bool:
  """Whether the model's chat template is harmony's (gpt-oss's)."""
  template = getattr(tokenizer, "chat_template", None) or ""
  return CHANNEL in template and "analysis" in template


def call_text(name: str, arguments: str) -> str:
  """A call as the answer carries it to HarmonyFormat (one header form, whichever the model wrote)."""
  return f"{CHANNEL}commentary to={FUNCTIONS}{name}{MESSAGE}{arguments}"


class HarmonySplit:
  """One choice's reply read as it streams: each piece in, (new thinking, new answer text) out. The answer holds the
  final channel (and commentary the model addresses to no one, its preambles); calls to the request's tools go on
  in the answer in call_text's form, for the tool format to read, when `with_calls` (else they are dropped: no
  tool was offered). Analysis messages are thinking (one line apart), whatever their recipient, unless they call a
  function. Each piece is read once: a header waits until it is whole, a body goes out as it comes."""

  def __init__(self, with_calls: bool):
    self.with_calls = with_calls
    self.pending = ""  # text not yet read
    self.state = "between"  # between messages (the reply starts there: its role is the prompt's), "header" or "body"
    self.kind = ""  # the current body's: "thinking", "answer", "call" or "drop"
    self.opened = False  # the current body has given out text
    self.thought = False  # some thinking has been given out

  def feed(self, text: str, final: bool) -> Tuple[str, str]:
    self.pending += text
    out = {"thinking": [], "answer": []}
    while self.pending:
      if self.state == "between" and not self._between(final):
        break
      if self.state == "header":
        at = self.pending.find(MESSAGE)
        if at < 0:
          if final:
            self.pending = ""  # a header cut off says nothing
          break
        self._open(self.pending[:at], out)
        self.pending = self.pending[at + len(MESSAGE):]
      if self.state == "body":
        ended = _BODY_END.search(self.pending)
        held = 0 if ended or final else marker_tail(self.pending, (END, RETURN, CALL, START))  # cut inside a marker
        body = self.pending[:ended.start()] if ended else self.pending[:len(self.pending) - held]
        self._give(body, out)
        self.pending = self.pending[len(body):]
        if not ended:
          break
        self.state = "between"
    return "".join(out["thinking"]), "".join(out["answer"])

  def _between(self, final: bool) -> bool:
    """Reads what follows a message (or starts the reply); False when it must wait for more text."""
    for marker in (START, END, RETURN, CALL):
      if self.pending.startswith(marker):
        self.pending = self.pending[len(marker):]
        self.state = "header" if marker == START else "between"
        return True
    if self.pending.startswith(_HEADER_HEADS):
      self.state = "header"
    elif not final and any(h.startswith(self.pending) for h in _HEADER_HEADS + (START, END, RETURN, CALL)):
      return False
    else:  # text outside any header: a model that does not keep to harmony, read as its answer
      self.state, self.kind, self.opened = "body", "answer", False
    return True

  def _open(self, header: str, out: dict) -> None:
    channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
    if recipient is not None and recipient.group(1).startswith(FUNCTIONS):
      self.kind = "call" if self.with_calls else "drop"
      if self.with_calls:
        out["answer"].append(call_text(recipient.group(1)[len(FUNCTIONS):], ""))
    else:
      self.kind = "thinking" if channel is not None and channel.group(1) == "analysis" else "answer"
    self.state, self.opened = "body", False

  def _give(self, body: str, out: dict) -> None:
    if not body or self.kind == "drop":
      return
    if self.kind == "thinking":
      if self.thought and not self.opened:
        body = "\n" + body  # a later analysis message starts a line of its own
      self.thought = True
      out["thinking"].append(body)
    else:
      out["answer"].append(body)
    self.opened = True


def grammar_after_analysis(source: str, tokenizer, answer_headed: bool) -> str:
  """The answer's grammar (Lark text whose first rule is `start`) after harmony's thinking: an analysis message the
  model may write first, then the answer as the grammar asks, under the final channel's header unless the grammar
  writes its own headers (`answer_headed`: HarmonyFormat's do)."""
  if not source.startswith("start:"):
    raise ValueError("the grammar's first rule must be start")
  channel, message, end, start = (grammar.marker(tokenizer, m) for m in (CHANNEL, MESSAGE, END, START))
  head = "" if answer_headed else f'{channel} "final" {message} '
  if end.startswith('"'):  # text: the thinking ends at the marker's first occurrence
    thought, rule = "thought", f"thought[lazy]: /(.|\\n)*{grammar.regex_literal(END)}/"
  else:  # a special token, which no text matches
    thought, rule = f"THOUGHT {end}", "THOUGHT: /(.|\\n)+/"
  return "\n".join([f"start: analysis? {head}after_analysis", "after_analysis:" + source[len("start:"):],
                    f'analysis: {channel} "analysis" {message} {thought} {start} "assistant"', rule])


class HarmonyFormat(ToolFormat):
  """Calls as gpt-oss writes them: one message `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
  {args}`, which ends the turn (`<|call|>`), so one call per reply. The grammar holds what follows the thinking: the
  call, or (tool_choice auto) a final answer instead."""
  name = "harmony"
  OPEN = f"{CHANNEL}commentary to={FUNCTIONS}"

  def grammar(self, use: ToolUse, reply: Optional[ResponseFormat]) -> str:
    channel, message, constrain = (grammar.marker(self.tokenizer, m) for m in (CHANNEL, MESSAGE, CONSTRAIN))
    lenient = not all(t.strict for t in use.callable)
    calls = " | ".join(f'{grammar.lark_string("commentary to=" + FUNCTIONS + t.name)} " " {constrain} "json" {message} {grammar.json_fragment(t.parameters, lenient=lenient)}'
                       for t in use.callable)
    lines = [f"call: {channel} ({calls})"]
    if use.forced:
      return "\n".join(["start: call"] + lines)
    answer = reply.fragment() if reply is not None else "TEXT?"
    return "\n".join(["start: call | final", f'final: {channel} "final" {message} {answer}', "TEXT: /(.|\\n)+/"] + lines)

  def view(self, text: str, final: bool) -> View:
    start = text.find(self.OPEN)
    if start < 0:
      return text, []
    calls, pos = [], start
    while pos >= 0:
      name_end = text.find(MESSAGE, pos + len(self.OPEN))
      if name_end < 0:
        break
      arguments_at = name_end + len(MESSAGE)
      end = json_value_end(text, arguments_at, final)
      calls.append(CallText(text[pos + len(self.OPEN):name_end], text[arguments_at:end if end is not None else len(text)], end is not None))
      if end is None:
        break
      pos = text.find(self.OPEN, end)
    return text[:start], calls

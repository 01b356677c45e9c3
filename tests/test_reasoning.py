"""A reasoning model's thinking read apart from its answer (exo/api/reasoning.py): which models reason (from their
template and tokenizer), how the text splits however it is cut into pieces, and how each dialect asks for thinking or
turns it off."""
import pytest

from exo.api.anthropic.request import parse_messages_request
from exo.api.chat_request import parse_chat_request
from exo.api.errors import BadRequest
from exo.api.ollama.request import parse_chat
from exo.api.reasoning import Reasoning, ReasoningSplit, reasoning_of, template_switches
from exo.inference.json_numbers import INTEGER, START, STRING, NumberBounds
from tests.support.pieces import split_in_pieces

pytestmark = pytest.mark.unit


class Template:
  def __init__(self, chat_template):
    self.chat_template = chat_template


def split(text: str, opened: bool, piece: int):
  """The text fed `piece` characters at a time: (all thinking, all answer)."""
  return split_in_pieces(ReasoningSplit(opened), text, piece)


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("text, opened, thinking, answer", [
  ("<think>\nAdd them up.\n</think>\n\nIt is 4.", False, "Add them up.", "It is 4."),  # Qwen3: the model opens the block
  ("\nAdd them up.\n</think>\n\nIt is 4.", True, "Add them up.", "It is 4."),  # R1 distills: the prompt opened it
  ("It is 4.", False, "", "It is 4."),  # no thinking (Qwen3 with thinking off, or a 2507 Instruct)
  ("\n\nIt is <think>4.", False, "", "It is <think>4."),  # a tag later in the answer is the answer's text
  ("<thin", False, "", "<thin"),  # the start of a tag, then the end
  ("Add them\n\n up and", True, "Add them\n\n up and", ""),  # cut off while thinking: all of it is thinking
  ("Add </thi", True, "Add </thi", ""),
  ("<think>a</think>b</think>", False, "a", "b</think>"),
  ("<think></think>\n\nIt is 4.", False, "", "It is 4."),
])
def test_thinking_splits_from_the_answer_however_the_text_arrives(text, opened, thinking, answer, piece):
  assert split(text, opened, piece) == (thinking, answer)


def test_nothing_is_sent_before_it_is_certain_which_part_it_belongs_to():
  reader = ReasoningSplit(opened=False)
  assert reader.feed("<th", False) == ("", "")
  assert reader.feed("ink>So", False) == ("So", "")
  assert reader.feed(" two \n</", False) == (" two", "")  # the blanks and the tag's start wait
  assert reader.feed("think>\n", False) == ("", "")
  assert reader.feed("\nFour", False) == ("", "Four")
  assert reader.feed(" it is", True) == ("", " it is")


def test_a_model_reasons_when_its_template_has_the_tags():
  assert reasoning_of(Template("{{ x.split('</think>')[-1] }}{% if enable_thinking is false %}<think>\n\n</think>{% endif %}")) == Reasoning(True)
  assert reasoning_of(Template("{{ c.split('</think>')[-1] }}<｜Assistant｜><think>\n")) == Reasoning(False)  # R1 distills
  assert reasoning_of(Template("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}")) is None
  assert reasoning_of(Template(None)) is None
  assert Reasoning.opened_by("<|im_start|>assistant\n<think>\n") and not Reasoning.opened_by("assistant\n<think>\n\n</think>\n\n")


def test_thinking_switch_goes_to_the_template_and_a_dialect_may_refuse_it():
  assert template_switches(Reasoning(True), False, {"x": 1}, None) == {"x": 1, "enable_thinking": False}
  assert template_switches(None, None, {}, "think") == {}
  assert template_switches(None, True, {}, None) == {"enable_thinking": True}  # vLLM's chat_template_kwargs pass through
  with pytest.raises(BadRequest) as e:
    template_switches(None, True, {}, "think")
  assert e.value.param == "think"


def chat(**fields):
  return parse_chat_request({"messages": [{"role": "user", "content": "hi"}], **fields}, "dummy", "DummyInferenceEngine")


def test_chat_template_kwargs_are_read_as_vllm_takes_them():
  request = chat(chat_template_kwargs={"enable_thinking": False, "reasoning_effort": "low"})
  assert (request.thinking, request.template_kwargs, request.fields.thinking) == (False, {"reasoning_effort": "low"}, None)
  assert chat().thinking is None
  assert (chat(reasoning_effort="none").thinking, chat(reasoning_effort="high").template_kwargs) == (False, {"reasoning_effort": "high"})
  assert chat(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}).thinking is False  # the explicit switch wins
  for value, param in (([1], "chat_template_kwargs"), ({"enable_thinking": "no"}, "chat_template_kwargs.enable_thinking"),
                       ({"messages": []}, "chat_template_kwargs.messages")):
    with pytest.raises(BadRequest) as e:
      chat(chat_template_kwargs=value)
    assert e.value.param == param


def test_ollama_think_and_anthropic_thinking_say_whether_to_think():
  ollama = {"model": "dummy", "messages": [{"role": "user", "content": "hi"}]}
  assert parse_chat({**ollama, "think": False}, "dummy", "DummyInferenceEngine").thinking is False
  assert parse_chat({**ollama, "think": True}, "dummy", "DummyInferenceEngine").fields.thinking == "think"
  leveled = parse_chat({**ollama, "think": "high"}, "dummy", "DummyInferenceEngine")  # gpt-oss's levels: its template reads them
  assert (leveled.thinking, leveled.template_kwargs) == (True, {"reasoning_effort": "high"})
  with pytest.raises(BadRequest, match="think"):
    parse_chat({**ollama, "think": "max"}, "dummy", "DummyInferenceEngine")
  anthropic = {"model": "dummy", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}]}
  for thinking, expected in (({"type": "disabled"}, False), ({"type": "enabled", "budget_tokens": 1024}, True), (None, None)):
    assert parse_messages_request({**anthropic, "thinking": thinking}, "dummy", "DummyInferenceEngine").thinking is expected
  for thinking, param in (({"type": "enabled", "budget_tokens": 4096}, "thinking.budget_tokens"), ({"type": "on"}, "thinking")):
    with pytest.raises(BadRequest) as e:
      parse_messages_request({**anthropic, "thinking": thinking}, "dummy", "DummyInferenceEngine")
    assert e.value.param == param


def test_the_json_lexer_starts_afresh_after_the_thinking():
  """Thinking is free text: a quote in it must not leave the answer's JSON read as inside a string."""
  bounds = NumberBounds(['"', "</think>", "1", "{"], restarts=[1])
  state = START
  for token in (0, 2):  # `"1`: inside a string
    state = bounds.advance(state, token)
  assert state[0] == STRING
  assert bounds.advance(state, 1) == START and bounds.advance(bounds.advance(state, 1), 2)[0] == INTEGER

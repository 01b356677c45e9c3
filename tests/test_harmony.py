"""gpt-oss's harmony replies (exo/api/harmony.py) read apart: the analysis channel as thinking, the final channel as
the answer, a message to functions.NAME as a tool call, however the text is cut into pieces; the markers never in
the answer. Pure code: texts written here in harmony's form, as gpt-oss writes them."""
import json

import pytest

from exo.api.harmony import HarmonyFormat, HarmonySplit
from exo.api.reasoning import Reasoning, reasoning_of
from exo.api.tool_formats import ToolCallStream, format_for
from tests.support.pieces import in_pieces, split_in_pieces

pytestmark = pytest.mark.unit

ANALYSIS = "<|channel|>analysis<|message|>The user asks for the weather. Use get_weather.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris","days":[1,2]}'


class Template:
  def __init__(self, chat_template):
    self.chat_template = chat_template


def split(text: str, piece: int, with_calls: bool = True):
  """The text fed `piece` characters at a time: (all thinking, all answer)."""
  return split_in_pieces(HarmonySplit(with_calls), text, piece)


def test_a_harmony_template_makes_a_harmony_reasoner_and_tool_format():
  harmony = Template("{{ '<|start|>assistant<|channel|>analysis<|message|>' }}...<|channel|>final")
  assert reasoning_of(harmony) == Reasoning(switchable=False, harmony=True)
  assert isinstance(format_for(harmony), HarmonyFormat)
  assert reasoning_of(Template("<|im_start|>{{ content }}")) is None


@pytest.mark.parametrize("piece", [1, 2, 5, 13, 10000])
@pytest.mark.parametrize("text, thinking, answer", [
  (ANALYSIS + FINAL, "The user asks for the weather. Use get_weather.", "It is sunny in Paris."),
  (FINAL[len("<|start|>assistant"):], "", "It is sunny in Paris."),  # no analysis (the model may go straight to its answer)
  (ANALYSIS, "The user asks for the weather. Use get_weather.", ""),  # cut off after its thinking
  (ANALYSIS[:-len("<|end|>")], "The user asks for the weather. Use get_weather.", ""),  # cut off while thinking
  ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>" + FINAL, "a\nb", "It is sunny in Paris."),
  ("<|channel|>commentary<|message|>Checking.<|end|>" + FINAL, "", "Checking.It is sunny in Paris."),  # a preamble is said to the user
  ("Plain text, no harmony at all", "", "Plain text, no harmony at all"),  # a model that ignores the format
  ("<|channel|>final", "", ""),  # a header cut off: no text yet
])
def test_channels_split_however_the_text_is_cut(text, thinking, answer, piece):
  assert split(text, piece) == (thinking, answer)


@pytest.mark.parametrize("piece", [1, 3, 10000])
@pytest.mark.parametrize("header", [
  "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
  " to=functions.get_weather<|channel|>commentary json<|message|>",  # the recipient in the role's header, as templates write earlier calls
])
def test_a_call_streams_as_an_openai_tool_call(header, piece):
  text = ANALYSIS + "<|start|>assistant" + header + '{"city":"Paris","days":[1,2]}'
  reader, stream = HarmonySplit(with_calls=True), ToolCallStream(HarmonyFormat(None))
  thinking, content, deltas = "", "", []
  for p, last in in_pieces(text, piece):
    t, a = reader.feed(p, last)
    c, d = stream.feed(a, last)
    thinking, content, deltas = thinking + t, content + c, deltas + d
  assert thinking == "The user asks for the weather. Use get_weather." and content == ""
  assert [d["function"]["name"] for d in deltas if "name" in d["function"]] == ["get_weather"]
  assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Paris", "days": [1, 2]}
  assert stream.final_content() is None and stream.tool_calls()[0]["function"]["name"] == "get_weather"


def test_a_call_to_a_tool_not_offered_is_dropped_never_shown():
  assert split(ANALYSIS + CALL, 4, with_calls=False) == ("The user asks for the weather. Use get_weather.", "")


def test_a_call_to_a_built_in_tool_in_the_analysis_channel_is_thinking():
  """gpt-oss's own browser and python tools are called from the analysis channel: no function of the request's."""
  text = "<|channel|>analysis to=browser.search<|message|>{\"query\": \"weather\"}<|call|>"
  assert split(text, 3) == ('{"query": "weather"}', "")


def test_the_analysis_grammar_compiles_with_markers_as_text_too():
  """A tokenizer without harmony's tokens (SmolLM2's): the markers are text, and the thinking ends at `<|end|>`."""
  from exo.api.harmony import grammar_after_analysis
  from exo.download.shard_download import embedded_model_path
  from exo.inference import grammar
  from exo.inference.tokenizers import tokenizer_from_gguf
  tokenizer = tokenizer_from_gguf(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))
  source = grammar_after_analysis('start: "{}"', tokenizer, answer_headed=False)
  matcher = grammar.compile_matcher(tokenizer, source)
  text = "<|channel|>analysis<|message|>hm, <|end|><|start|>assistant<|channel|>final<|message|>{}"
  assert matcher.consume_tokens(list(tokenizer.encode(text, add_special_tokens=False))) and matcher.is_accepting()

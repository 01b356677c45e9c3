"""The dialects' body models (exo/api/body_model.py and each dialect's request module): pydantic's faults become
the project's BadRequest naming the field by its whole path, an unknown field is named before any other fault, a
field left null takes its default, and a body model's errors never escape as anything but a 400."""
import pytest

from exo.api.anthropic.request import MessagesBody
from exo.api.chat_request import ChatBody
from exo.api.completion_request import CompletionBody
from exo.api.embedding_request import OllamaEmbedBody, OllamaEmbeddingsBody, OpenAIEmbeddingBody
from exo.api.errors import BadRequest
from exo.api.ollama.request import ChatBody as OllamaChatBody
from exo.api.ollama.request import GenerateBody
from exo.api.openai_responses.request import ResponsesBody

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "x"}]
BODIES = [(ChatBody, {"messages": USER}), (CompletionBody, {"prompt": "x"}), (MessagesBody, {"messages": USER, "max_tokens": 5}),
          (ResponsesBody, {"input": "x"}), (OllamaChatBody, {"model": "m", "messages": USER}), (GenerateBody, {"model": "m", "prompt": "x"}),
          (OpenAIEmbeddingBody, {"input": "x"}), (OllamaEmbedBody, {"model": "m", "input": "x"}),
          (OllamaEmbeddingsBody, {"model": "m", "prompt": "x"})]


def fault(model, body) -> BadRequest:
  with pytest.raises(BadRequest) as error:
    model.read(body)
  return error.value


@pytest.mark.parametrize("model,good", BODIES)
def test_null_in_every_optional_field_is_its_default(model, good):
  required = {name for name, info in model.model_fields.items() if name in good}
  nulls = {name: None for name in model.model_fields if name not in required}
  assert model.read({**good, **nulls}) == model.read(good)


@pytest.mark.parametrize("model,good", BODIES)
def test_an_unknown_field_is_named_before_any_other_fault(model, good):
  error = fault(model, {"zz_unknown": 1, **good, **{name: {"odd": []} for name in list(model.model_fields)[-3:]}})
  assert (error.param, error.code, error.message) == ("zz_unknown", "unsupported_parameter", "Unrecognized request argument supplied: zz_unknown")


def test_a_nested_fault_is_named_by_its_whole_path():
  messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": [{"type": "text", "text": 5}]}]
  error = fault(MessagesBody, {"messages": messages, "max_tokens": 5})
  assert (error.param, error.message) == ("messages[1].content[0].text", "messages[1].content[0].text must be a string")
  error = fault(OllamaChatBody, {"model": "m", "messages": USER, "options": {"num_ctx": 0}})
  assert (error.param, error.message) == ("options.num_ctx", "options.num_ctx must be an integer >= 1")
  assert fault(OllamaChatBody, {"model": "m", "messages": USER, "options": {"warp": 9}}).param == "options.warp"
  error = fault(ChatBody, {"messages": USER, "chat_template_kwargs": {"tools": []}})
  assert (error.param, error.message) == ("chat_template_kwargs.tools", "chat_template_kwargs.tools is the request's own to set")


def test_a_closed_object_with_another_key_names_the_object():
  error = fault(ResponsesBody, {"input": "x", "reasoning": {"effort": "low", "budget": 1}})
  assert (error.param, error.message) == ("reasoning", 'reasoning must be an object such as {"effort": "medium"}')


def test_values_read_as_the_core_takes_them():
  chat = ChatBody.read({"messages": USER, "stop": "x", "seed": -1, "logit_bias": {"7": -100, "3": 1}})
  assert (chat.stop, chat.seed, chat.logit_bias, chat.parallel_tool_calls, chat.stream) == (["x"], -1, ((3, 1.0), (7, -100.0)), True, False)
  assert OllamaEmbedBody.read({"model": "m", "input": "x", "keep_alive": "1m30s", "truncate": None}).truncate is True
  assert OllamaEmbedBody.read({"model": "m", "input": "x", "keep_alive": "1m30s"}).keep_alive == 90.0

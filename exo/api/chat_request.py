"""OpenAI chat completions (POST /v1/chat/completions) read into a GenerationRequest: the model, the messages, the
sampling parameters, tools and response_format. Bad input raises BadRequest naming the field and saying why; a
parameter this server does not implement is refused the same way, never silently ignored."""
from typing import Annotated, Any, Dict, List, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, StrictStr, field_validator, model_validator

from exo.api.body_model import Body, Flag, Switch, Text, checked, invalid
from exo.api.generation_request import GenerationRequest
from exo.api.reasoning import Effort, parse_effort
from exo.api.request_fields import LogprobCount, MaxTokens, OpenAIBody, resolve_model, sampling_params
from exo.api.structured import parse_response_format
from exo.api.tools import Calling, ChatToolFields, earlier_calls

IMAGE_PLACEHOLDER = "[An image was uploaded but is not displayed here]"
ROLES = {"system", "user", "assistant", "tool", "developer"}
# What the template is given by the server itself, which chat_template_kwargs may not replace.
TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


class TemplateKwargs(BaseModel):
  """vLLM's `chat_template_kwargs`: variables for the chat template, `enable_thinking` (Qwen3's switch) among them."""
  model_config = ConfigDict(extra="allow")
  enable_thinking: Switch = None

  @model_validator(mode="before")
  @classmethod
  def _not_the_requests_own(cls, value: Any) -> Any:
    reserved = sorted(set(value) & TEMPLATE_OWN) if isinstance(value, dict) else []
    if reserved:
      raise invalid("is the request's own to set", at=f".{reserved[0]}")
    return value


def text_of(content: Any) -> str:
  """Message content as the text a text-only model sees: parts joined, images as a placeholder."""
  if content is None or isinstance(content, str):
    return content or ""
  if not isinstance(content, list):
    raise invalid("must be a string or a list of content parts")
  texts = []
  for i, part in enumerate(content):
    if isinstance(part, str):
      texts.append(part)
    elif isinstance(part, dict) and part.get("type") in ("image_url", "image"):
      texts.append(IMAGE_PLACEHOLDER)
    elif isinstance(part, dict) and isinstance(part.get("text"), str):
      texts.append(part["text"])
    else:
      raise invalid('must be a text part ({"type": "text", "text": ...}) or an image part', at=f"[{i}]")
  return "\n".join(texts)


class CalledFunction(BaseModel):
  model_config = ConfigDict(extra="allow")  # (what a client adds is the template's to read or leave)
  name: StrictStr
  arguments: StrictStr = ""  # JSON text


class ToolCall(BaseModel):
  model_config = ConfigDict(extra="allow")
  id: StrictStr = ""
  type: Literal["function"] = "function"
  function: CalledFunction


class Message(Calling):
  """A message with its content as text, and its other keys (a per-message `tools`) as they are. A `developer`
  message is what OpenAI now calls a system message, and goes to the template as one."""
  model_config = ConfigDict(extra="allow")
  role: Annotated[checked(Literal[tuple(sorted(ROLES))], f"must be one of {', '.join(sorted(ROLES))}", optional=False),
                  AfterValidator(lambda role: "system" if role == "developer" else role)]
  content: Annotated[str, PlainValidator(text_of)]
  tool_calls: earlier_calls(ToolCall, '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}') = None
  tool_call_id: Text = None


Messages = List[checked(Message, 'must be an object with a string "role" and a "content"', optional=False)]
MESSAGES_WHY = 'is required: a non-empty list of {"role": ..., "content": ...} objects'


def as_dicts(messages: Optional[List[Message]]) -> List[Dict[str, Any]]:
  """The messages as the chat template takes them: the keys each was given."""
  return [message.model_dump(exclude_unset=True) for message in messages or []]


class EncodeBody(ChatToolFields, Body):
  """Upstream's token-encode route: the prompt that a chat request's messages and tools make (other keys ignored)."""
  model_config = ConfigDict(extra="ignore")
  model: Any = None
  messages: checked(Messages, MESSAGES_WHY) = None

  def template_tools(self, body: dict) -> Optional[List[Any]]:
    """The tools the chat template is given, as the request wrote them (none when tool_choice is "none")."""
    self.tool_use()
    return None if self.tool_choice == "none" else body.get("tools")


class ChatBody(ChatToolFields, OpenAIBody):
  """OpenAI's chat completion body (the tools and response_format are read by exo/api/tools.py and exo/api/structured.py)."""
  messages: checked(Annotated[Messages, Field(min_length=1)], MESSAGES_WHY, optional=False) = None
  max_completion_tokens: MaxTokens = None
  response_format: Any = None
  logprobs: Flag = None
  top_logprobs: LogprobCount = None
  chat_template_kwargs: checked(TemplateKwargs, 'must be an object such as {"enable_thinking": false}') = None
  reasoning_effort: Effort = None

  def budget(self) -> Optional[int]:
    return self.max_completion_tokens or self.max_tokens  # (OpenAI's newer name wins)

  @field_validator("top_logprobs")
  @classmethod
  def _top_needs_logprobs(cls, top: Optional[int], info) -> Optional[int]:
    if top is not None and not info.data.get("logprobs"):
      raise invalid("needs logprobs set to true")
    return top


def parse_chat_request(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  chat = ChatBody.read(body)
  model = resolve_model(chat.model, default_model, engine_classname)
  messages = as_dicts(chat.messages)
  params = sampling_params(chat, default_temperature, max_tokens=chat.budget(), logprobs=(chat.top_logprobs or 0) if chat.logprobs else None)
  kwargs = chat.chat_template_kwargs or TemplateKwargs()
  # OpenAI's reasoning_effort: "none" turns thinking off where the template can; gpt-oss's template reads the degree.
  # chat_template_kwargs, the more explicit, win where both speak.
  effort_thinking, effort_kwargs = parse_effort(chat.reasoning_effort)
  thinking = kwargs.enable_thinking if kwargs.enable_thinking is not None else effort_thinking
  return GenerationRequest(model, messages=messages, params=params, stop=chat.stop, tool_use=chat.tool_use(),
                           response_format=parse_response_format(body), n=chat.n or 1, stream=bool(chat.stream),
                           stream_usage=bool(chat.stream_options and chat.stream_options.include_usage), thinking=thinking,
                           template_kwargs={**effort_kwargs, **kwargs.model_extra})

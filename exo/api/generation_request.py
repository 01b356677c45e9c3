"""What the serving core is asked for: one generation request, parsed by a dialect from its own body (OpenAI chat or
completions, Anthropic Messages, OpenAI Responses, Ollama) and served the same way whichever it came from."""
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from exo.api.structured import ResponseFormat
from exo.api.tools import ToolUse
from exo.inference.sampling import SamplingParams

Prompt = Union[str, List[int]]  # a raw prompt: text, or token ids


@dataclass(frozen=True)
class FieldNames:
  """The dialect's names of the fields the core's errors point at."""
  prompt: str = "messages"  # the conversation or prompt, when it does not fit the context
  max_tokens: str = "max_tokens"  # the reply's token budget
  context: str = "num_ctx"  # the client's own context size, where its dialect has one
  thinking: Optional[str] = None  # the field that asked for thinking, where asking a model that does not think is refused


@dataclass
class GenerationRequest:
  """Either `messages` (a conversation in OpenAI chat's form: string content, assistant `tool_calls` with JSON-text
  arguments, `tool` messages with `tool_call_id`), templated with the model's chat template, or `prompts` given to
  the model as they are (n choices of each)."""
  model: str
  messages: Optional[List[Dict[str, Any]]] = None
  prompts: Optional[List[Prompt]] = None
  params: SamplingParams = field(default_factory=SamplingParams)
  stop: List[str] = field(default_factory=list)
  tool_use: Optional[ToolUse] = None  # what calls the answer may hold (None: no tool may be called)
  response_format: Optional[ResponseFormat] = None
  n: int = 1
  echo: bool = False  # each choice's text starts with its prompt
  stream: bool = False
  stream_usage: bool = False  # OpenAI's stream_options.include_usage
  context: Optional[int] = None  # a context the client asks for (Ollama's num_ctx): prompt and reply must fit it too
  thinking: Optional[bool] = None  # whether a reasoning model thinks first (None: as its chat template does by default)
  template_kwargs: Dict[str, Any] = field(default_factory=dict)  # more variables for the chat template (chat_template_kwargs)
  keep_alive: Optional[float] = None  # seconds its model stays loaded after it (Ollama's keep_alive; the node's default when None)
  fields: FieldNames = field(default_factory=FieldNames)

  @property
  def choice_count(self) -> int:
    return (len(self.prompts) if self.prompts is not None else 1) * self.n

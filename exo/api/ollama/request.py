"""Ollama's /api/chat and /api/generate bodies read into GenerationRequests: the messages (tool calls with their
arguments as objects, tool results) or the prompt (templated as a user turn, or `raw`), `options` (temperature,
top_p, top_k, min_p, seed, num_predict, stop, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty,
num_ctx), `format` ("json" or a JSON Schema), tools on chat. Ollama streams
unless told not to. Bad input is a 400 naming the field; a model this node does not have is a 404, as Ollama's."""
import json
from typing import Annotated, Any, Dict, List, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictStr, create_model

from exo.api.body_model import MAX_INT32, Body, Flag, Text, checked, flag, integer, neutral, one_of
from exo.api.chat_request import IMAGE_PLACEHOLDER
from exo.api.embedding_request import KeepAlive
from exo.api.errors import ApiError, BadRequest
from exo.api.generation_request import FieldNames, GenerationRequest
from exo.api.reasoning import parse_effort
from exo.api.request_fields import LogprobCount, RepetitionPenalty, Sampling, resolve_model, sampling_params, stop_strings
from exo.api.structured import ResponseFormat, format_of
from exo.api.tools import Calling, ChatTools, chat_tool_use, earlier_calls

THINK_LEVELS = ("low", "medium", "high")
REPEAT_LAST_N = 64  # Ollama's default window for its penalties
ROLES = {"system", "user", "assistant", "tool"}
LATEST = ":latest"


def _not_zero(predict: int) -> int:
  if predict == 0:
    raise ValueError("0 tokens")
  return predict


class SamplingOptions(Sampling):
  """Ollama's `options` under Ollama's names; those it has and this server does not implement are taken when neutral."""
  num_predict: checked(Annotated[int, Field(strict=True, ge=-2, le=MAX_INT32), AfterValidator(_not_zero)],
                       "must be an integer >= 1, or -1 (until the context is full)") = None
  stop: stop_strings(16) = None
  repeat_penalty: RepetitionPenalty = None
  repeat_last_n: integer(-1, "must be an integer >= 0, or -1 (the whole context)") = None
  num_ctx: integer(1, "must be an integer >= 1") = None
  typical_p: neutral(1) = None
  tfs_z: neutral(1) = None
  mirostat: neutral(0) = None


# How a node runs (its threads, memory): the node's own settings, so these options are accepted and have no effect.
RUNTIME_OPTIONS = ("num_batch", "num_gpu", "main_gpu", "num_thread", "use_mmap", "use_mlock", "numa", "low_vram", "num_keep", "penalize_newline",
                   "mirostat_tau", "mirostat_eta")
Options = create_model("Options", __base__=SamplingOptions, **{name: (Any, None) for name in RUNTIME_OPTIONS})


Images = checked(List[Any], "must be a list of base64 images")


class OllamaBody(Body):
  """What /api/chat's and /api/generate's bodies share (the model, the messages, tools and format are read below)."""
  model: Any = None
  format: Any = None
  options: checked(Options, 'must be an object such as {"temperature": 0}') = None
  stream: flag(True) = True
  keep_alive: KeepAlive = None  # seconds its model stays loaded after it (Ollama's; the node's default when None)
  think: one_of((True, False) + THINK_LEVELS, f"must be true, false or one of {', '.join(THINK_LEVELS)}", "unsupported_parameter") = None
  logprobs: Flag = None
  top_logprobs: LogprobCount = None


class CalledFunction(BaseModel):
  name: StrictStr
  arguments: Dict[str, Any] = {}


class ToolCall(BaseModel):
  function: CalledFunction


class Message(Calling):
  """A message: its text, images (a text-only model is told they were there), an assistant's tool calls, or a tool's result."""
  model_config = ConfigDict(validate_default=True)
  role: Literal[tuple(sorted(ROLES))]
  content: Text = None
  images: Images = None
  tool_calls: earlier_calls(ToolCall, '{"function": {"name": ..., "arguments": {...}}}') = None
  tool_name: Text = None


class ChatBody(OllamaBody):
  messages: checked(List[checked(Message, f'must be an object with "role" one of {", ".join(sorted(ROLES))}', optional=False)],
                    'must be a list of {"role": ..., "content": ...} objects') = None
  tools: ChatTools = None


class GenerateBody(OllamaBody):
  prompt: Text = None
  system: Text = None
  raw: Flag = None
  images: Images = None
  suffix: neutral("") = None
  template: neutral("") = None
  context: neutral([]) = None


def resolve_ollama_model(name: Any, default_model: str, engine_classname: str, field: str = "model") -> str:
  """Ollama's model names with their tag: `name` and `name:latest` are the registry's `name`."""
  if not isinstance(name, str) or not name:
    raise BadRequest(f"{field} is required", param=field)
  try:
    return resolve_model(name.removesuffix(LATEST), default_model, engine_classname, fallback_prefixes=())
  except BadRequest as e:
    if e.code == "model_not_found":
      raise ApiError(404, f"model '{name}' not found", param=field, code="model_not_found") from None
    raise


def _format(value: Any) -> Optional[ResponseFormat]:
  if value in (None, ""):
    return None
  if value == "json":
    return format_of("json_object", None, "format", "format")
  if isinstance(value, dict):
    return format_of("json_schema", {"schema": value}, "format", "format")
  raise BadRequest('format must be "json" or a JSON Schema object', param="format")


def _common(body: OllamaBody, default_model: str, engine_classname: str, default_temperature: float, prompt_field: str) -> Dict[str, Any]:
  """The GenerationRequest's fields that chat and generate share."""
  options = body.options or Options()
  predict = options.num_predict if options.num_predict and options.num_predict > 0 else None
  window = REPEAT_LAST_N if options.repeat_last_n is None else MAX_INT32 if options.repeat_last_n == -1 else options.repeat_last_n
  params = sampling_params(options, default_temperature, max_tokens=predict, repetition_penalty=options.repeat_penalty, penalty_window=window,
                           logprobs=(body.top_logprobs or 0) if body.logprobs else None)
  # `think`: true (a reasoning model thinks first; a model that does not is a 400), false (it answers at once, where its
  # template can), absent (as its template does by default), or the levels gpt-oss takes: it thinks, and its template
  # reads the level as `reasoning_effort`.
  thinking, template_kwargs = parse_effort(body.think) if isinstance(body.think, str) else (body.think, {})
  return {"model": resolve_ollama_model(body.model, default_model, engine_classname), "params": params, "stop": options.stop,
          "response_format": _format(body.format), "context": options.num_ctx, "stream": body.stream, "thinking": thinking,
          "template_kwargs": template_kwargs, "keep_alive": body.keep_alive,
          "fields": FieldNames(prompt=prompt_field, max_tokens="options.num_predict", context="options.num_ctx", thinking="think")}


def _images(images: Optional[list]) -> str:
  return "".join("\n" + IMAGE_PLACEHOLDER for _ in images or [])


def _conversation(messages: List[Message]) -> List[Dict[str, Any]]:
  """Ollama's messages as the core's conversation: tool calls get ids, and each tool result answers the earliest
  unanswered call of its `tool_name` (or, without one, the earliest unanswered call)."""
  out, pending = [], []
  for i, message in enumerate(messages):
    converted = {"role": message.role, "content": (message.content or "") + _images(message.images)}
    if message.tool_calls is not None:
      converted["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function", "function": {"name": call.function.name,
                                                                                            "arguments": json.dumps(call.function.arguments)}}
                                 for j, call in enumerate(message.tool_calls)]
      pending += [(call["id"], call["function"]["name"]) for call in converted["tool_calls"]]
    if message.role == "tool":
      answered = next((p for p in pending if message.tool_name is None or p[1] == message.tool_name), None)
      if answered is not None:
        pending.remove(answered)
        converted["tool_call_id"] = answered[0]
    out.append(converted)
  return out


def parse_chat(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  chat = ChatBody.read(body)
  common = _common(chat, default_model, engine_classname, default_temperature, "messages")
  messages = _conversation(chat.messages or [])
  if not messages:
    raise BadRequest("messages is required: a non-empty list", param="messages")  # (Ollama loads the model; this node's is always loaded)
  return GenerationRequest(messages=messages, tool_use=chat_tool_use(chat.tools), **common)


def parse_generate(body: Dict[str, Any], default_model: str, engine_classname: str, default_temperature: float = 0.0) -> GenerationRequest:
  """An empty prompt (Ollama's way to load a model) is the raw prompt "", which is not to be run."""
  generate = GenerateBody.read(body)
  common = _common(generate, default_model, engine_classname, default_temperature, "prompt")
  prompt, system = generate.prompt or "", generate.system
  if not prompt:
    return GenerationRequest(prompts=[""], **common)
  if generate.raw:
    if system or generate.images:
      raise BadRequest("a raw prompt is given to the model as it is: put the system prompt and images in it", param="raw")
    return GenerationRequest(prompts=[prompt], **common)
  messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt + _images(generate.images)}]
  return GenerationRequest(messages=messages, **common)

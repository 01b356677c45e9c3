"""Embedding request bodies read and checked: OpenAI's /v1/embeddings (`input` a string, a list of strings, a list of
token ids or a list of those; `encoding_format`; `dimensions`) and Ollama's /api/embed (`input` a string or a list of
strings, `truncate`, `dimensions`) and /api/embeddings (`prompt`), both with Ollama's `keep_alive`. Bad input is a 400 naming the field.
A model is named by its registry id or alias, or by the absolute path of a served local checkpoint. exo's own
`prompt_name` on /v1/embeddings picks a prompt of the model's sentence-transformers configuration (Qwen3-Embedding's
`query` instruction); Ollama's routes have no such field, so their clients put the instruction in the text.

Token ids are the embedding model's own, taken as the encoder sees them (as vLLM takes them): a client that
tokenises itself includes the model's special tokens ([CLS] ... [SEP] for BERT) as its tokenizer adds them."""
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, List, Mapping, Optional, Union

from pydantic import Field, PlainValidator

from exo.api.body_model import MAX_INT32, Body, Flag, Object, Text, checked, flag, integer, invalid, one_of
from exo.api.errors import ApiError, BadRequest
from exo.api.request_fields import is_int, is_number
from exo.embeddings.registry import DEFAULT_EMBEDDING_MODEL, FALLBACK_PREFIXES, embedding_cards, embedding_model_id, is_local, local_checkpoint
from exo.models import model_cards

MAX_INPUTS = 2048  # items in one request, as OpenAI's API
ENCODING_FORMATS = ("float", "base64")

Input = Union[str, List[int]]


@dataclass(frozen=True)
class EmbeddingFields:
  """The names the dialect gives the fields, for error messages."""
  input: str = "input"
  dimensions: str = "dimensions"


@dataclass(frozen=True)
class EmbeddingRequest:
  model: str  # an id in exo/embeddings/registry.py
  inputs: List[Input]  # texts, or token id lists
  encoding_format: str = "float"
  dimensions: Optional[int] = None
  truncate: bool = False  # cut over-long inputs to the model's limit instead of refusing them
  fields: EmbeddingFields = EmbeddingFields()
  single: bool = False  # `input` was one item, not a list (its error messages say `input`, not `input[0]`)
  truncate_hint: str = " (send \"truncate\": true to cut it to the limit)"
  keep_alive: Optional[float] = None  # seconds the model stays loaded after this request (the node's default when None)
  prompt_name: Optional[str] = None  # a prompt of the model's sentence-transformers configuration, put before each text

  def item_name(self, index: int) -> str:
    return self.fields.input if self.single else f"{self.fields.input}[{index}]"


def resolve_embedding_model(requested: Any, default: str = DEFAULT_EMBEDDING_MODEL, fallback_prefixes=FALLBACK_PREFIXES,
                            missing_status: int = 400) -> str:
  """The embedding model a name means: an id or alias; left out, or an OpenAI embedding model's name, the default one."""
  if requested is not None and not isinstance(requested, str):
    raise BadRequest("model must be a string", param="model")
  if not requested or requested.startswith(tuple(fallback_prefixes)):
    return default
  model_id = embedding_model_id(requested)
  if model_id is not None and is_local(model_id):
    try:
      local_checkpoint(model_id)
    except ValueError as e:
      raise ApiError(missing_status, str(e), param="model", code="model_not_found") from None
  if model_id is not None:
    return model_id
  what = "a chat model, not an embedding model" if requested in model_cards else "not an embedding model this node has"
  raise ApiError(missing_status, f"{requested} is {what}; embedding models: {sorted(embedding_cards)}", param="model", code="model_not_found")


def _token_list(value: list, name: str) -> List[int]:
  if not value:
    raise BadRequest(f"{name} is an empty list of token ids", param=name)
  for j, token in enumerate(value):
    if not is_int(token) or not 0 <= token <= MAX_INT32:
      raise BadRequest(f"{name}[{j}] must be a token id (an integer >= 0), not {str(token)[:40]!r}", param=f"{name}[{j}]")
  return value


def parse_inputs(value: Any, name: str, token_ids: bool) -> tuple:
  """(items, single): a string, or a list of strings; with token_ids also a list of ids or a list of id lists."""
  what = "a string, a list of strings, a list of token ids or a list of lists of token ids" if token_ids else "a string or a list of strings"
  if isinstance(value, str):
    return [value], True
  if not isinstance(value, list):
    raise BadRequest(f"{name} is required, as {what}" if value is None else f"{name} must be {what}", param=name)
  if not value:
    raise BadRequest(f"{name} must not be an empty list", param=name)
  if token_ids and not any(isinstance(v, (str, list)) for v in value):  # one input as token ids (its length is the model's to judge)
    return [_token_list(value, name)], True
  if len(value) > MAX_INPUTS:
    raise BadRequest(f"{name} holds {len(value)} items; at most {MAX_INPUTS} per request", param=name)
  items = []
  for i, item in enumerate(value):
    if isinstance(item, str):
      items.append(item)
    elif token_ids and isinstance(item, list):
      items.append(_token_list(item, f"{name}[{i}]"))
    else:
      raise BadRequest(f"{name}[{i}] must be {'a string or a list of token ids' if token_ids else 'a string'}, not {type(item).__name__}",
                       param=f"{name}[{i}]")
  if token_ids and len({isinstance(item, str) for item in items}) > 1:
    raise BadRequest(f"{name} mixes strings and token id lists; send one kind", param=name)
  return items, False


DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> Optional[float]:
  """Seconds from Ollama's keep_alive: a number of seconds, or a Go duration ("5m", "1h30m", "300ms"); negative
  means forever (math.inf), 0 unload at once. None when not given; ValueError saying what it must be otherwise."""
  if value is None:
    return None
  seconds = None
  if is_number(value):
    seconds = float(value)
  elif isinstance(value, str):
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    try:
      seconds = sign * float(body)  # a bare number, as Ollama's clients also send it
    except ValueError:
      parts = DURATION.findall(body)
      if parts and "".join(n + u for n, u in parts) == body:
        seconds = sign * sum(float(n) * UNIT_S[u] for n, u in parts)
  if seconds is None:
    raise ValueError('must be a number of seconds or a duration such as "5m" or "1h30m" (negative: keep the model loaded)')
  return math.inf if seconds < 0 else seconds


def _duration(value: Any) -> Optional[float]:
  try:
    return parse_duration(value)
  except ValueError as e:
    raise invalid(str(e)) from None


Dimensions = integer(1, "must be an integer >= 1")
OllamaModel = checked(Annotated[str, Field(strict=True, min_length=1)], "is required", optional=False)
KeepAlive = Annotated[Optional[float], PlainValidator(_duration)]
Options = Object  # (Ollama's runtime options: nothing to change for an embedding)


class OpenAIEmbeddingBody(Body):
  model: Any = None
  input: Any = None
  encoding_format: one_of(ENCODING_FORMATS + ("",), f"must be one of {list(ENCODING_FORMATS)}") = None
  dimensions: Dimensions = None
  user: Text = None
  truncate: Flag = None
  prompt_name: checked(Annotated[str, Field(strict=True)],
                       "must be a string: the name of a prompt in the model's sentence-transformers configuration") = None


class OllamaEmbeddingBody(Body):
  """What Ollama's two embedding routes take besides their text."""
  model: OllamaModel = None
  options: Options = None
  keep_alive: KeepAlive = None


class OllamaEmbedBody(OllamaEmbeddingBody):
  input: Any = None
  truncate: flag(True) = True
  dimensions: Dimensions = None


class OllamaEmbeddingsBody(OllamaEmbeddingBody):
  prompt: checked(Annotated[str, Field(strict=True)], "is required, as a string", optional=False) = None


def parse_openai_embedding(body: Mapping) -> EmbeddingRequest:
  fields = OpenAIEmbeddingBody.read(body)
  inputs, single = parse_inputs(fields.input, "input", token_ids=True)
  if fields.prompt_name is not None and not isinstance(inputs[0], str):
    raise BadRequest("prompt_name applies to texts; token id inputs already hold whatever prompt they need", param="prompt_name")
  return EmbeddingRequest(resolve_embedding_model(fields.model), inputs, fields.encoding_format or "float", fields.dimensions, fields.truncate,
                          single=single, prompt_name=fields.prompt_name)


def parse_ollama_embed(body: Mapping) -> EmbeddingRequest:
  """/api/embed: Ollama cuts over-long inputs unless `truncate` is false."""
  fields = OllamaEmbedBody.read(body)
  inputs, single = parse_inputs(fields.input, "input", token_ids=False)
  return EmbeddingRequest(resolve_embedding_model(fields.model, fallback_prefixes=(), missing_status=404), inputs, dimensions=fields.dimensions,
                          truncate=fields.truncate, single=single,
                          truncate_hint=" (leave truncate unset or true to cut it to the limit)", keep_alive=fields.keep_alive)


def parse_ollama_embeddings(body: Mapping) -> EmbeddingRequest:
  """/api/embeddings, the older route: one `prompt`, cut to the model's limit as Ollama does."""
  fields = OllamaEmbeddingsBody.read(body)
  return EmbeddingRequest(resolve_embedding_model(fields.model, fallback_prefixes=(), missing_status=404), [fields.prompt], truncate=True,
                          fields=EmbeddingFields(input="prompt"), single=True, keep_alive=fields.keep_alive)

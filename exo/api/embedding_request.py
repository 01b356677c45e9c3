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
from typing import Any, List, Mapping, Optional, Union

from exo.api.errors import ApiError, BadRequest
from exo.api.request_fields import MAX_INT32, is_int, is_number, parse_flag, refuse_unimplemented
from exo.embeddings.registry import DEFAULT_EMBEDDING_MODEL, FALLBACK_PREFIXES, embedding_cards, embedding_model_id, is_local, local_checkpoint
from exo.models import model_cards

MAX_INPUTS = 2048  # items in one request, as OpenAI's API
ENCODING_FORMATS = ("float", "base64")
OPENAI_FIELDS = {"model", "input", "encoding_format", "dimensions", "user", "truncate", "prompt_name"}
OLLAMA_EMBED_FIELDS = {"model", "input", "truncate", "dimensions", "options", "keep_alive"}
OLLAMA_EMBEDDINGS_FIELDS = {"model", "prompt", "options", "keep_alive"}

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


def parse_dimensions(body: Mapping) -> Optional[int]:
  value = body.get("dimensions")
  if value is not None and (not is_int(value) or not 1 <= value <= MAX_INT32):
    raise BadRequest("dimensions must be an integer >= 1", param="dimensions")
  return value


def parse_openai_embedding(body: Mapping) -> EmbeddingRequest:
  refuse_unimplemented(body, OPENAI_FIELDS, {})
  fmt = body.get("encoding_format") or "float"
  if fmt not in ENCODING_FORMATS:
    raise BadRequest(f"encoding_format must be one of {list(ENCODING_FORMATS)}", param="encoding_format")
  if body.get("user") is not None and not isinstance(body["user"], str):
    raise BadRequest("user must be a string", param="user")
  inputs, single = parse_inputs(body.get("input"), "input", token_ids=True)
  prompt_name = body.get("prompt_name")
  if prompt_name is not None and not isinstance(prompt_name, str):
    raise BadRequest("prompt_name must be a string: the name of a prompt in the model's sentence-transformers configuration", param="prompt_name")
  if prompt_name is not None and not isinstance(inputs[0], str):
    raise BadRequest("prompt_name applies to texts; token id inputs already hold whatever prompt they need", param="prompt_name")
  return EmbeddingRequest(resolve_embedding_model(body.get("model")), inputs, fmt, parse_dimensions(body), parse_flag(body, "truncate"),
                          single=single, prompt_name=prompt_name)


DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: Any, name: str = "keep_alive") -> Optional[float]:
  """Seconds from Ollama's keep_alive: a number of seconds, or a Go duration ("5m", "1h30m", "300ms"); negative
  means forever (math.inf), 0 unload at once. None when not given."""
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
    raise BadRequest(f'{name} must be a number of seconds or a duration such as "5m" or "1h30m" (negative: keep the model loaded)', param=name)
  return math.inf if seconds < 0 else seconds


def _ollama_model(body: Mapping) -> str:
  name = body.get("model")
  if not isinstance(name, str) or not name:
    raise BadRequest("model is required", param="model")
  return resolve_embedding_model(name, fallback_prefixes=(), missing_status=404)


def _check_options(body: Mapping) -> None:
  options = body.get("options")
  if options is not None and not isinstance(options, dict):
    raise BadRequest("options must be an object", param="options")


def parse_ollama_embed(body: Mapping) -> EmbeddingRequest:
  """/api/embed: Ollama cuts over-long inputs unless `truncate` is false."""
  refuse_unimplemented(body, OLLAMA_EMBED_FIELDS, {})
  _check_options(body)
  inputs, single = parse_inputs(body.get("input"), "input", token_ids=False)
  return EmbeddingRequest(_ollama_model(body), inputs, dimensions=parse_dimensions(body), truncate=parse_flag(body, "truncate", True),
                          single=single, truncate_hint=" (leave truncate unset or true to cut it to the limit)",
                          keep_alive=parse_duration(body.get("keep_alive")))


def parse_ollama_embeddings(body: Mapping) -> EmbeddingRequest:
  """/api/embeddings, the older route: one `prompt`, cut to the model's limit as Ollama does."""
  refuse_unimplemented(body, OLLAMA_EMBEDDINGS_FIELDS, {})
  _check_options(body)
  prompt = body.get("prompt")
  if not isinstance(prompt, str):
    raise BadRequest("prompt is required, as a string", param="prompt")
  return EmbeddingRequest(_ollama_model(body), [prompt], truncate=True, fields=EmbeddingFields(input="prompt"), single=True,
                          keep_alive=parse_duration(body.get("keep_alive")))

"""Tokenizers: from a GGUF file's metadata or a tokenizer.json directory, with the model's own chat template."""
import json
import weakref
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Union

import numpy as np
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from exo.inference.gguf_header import is_gguf


class DummyTokenizer:
  def __init__(self):
    self.eos_token_id = 69
    self.eos_token_ids = {69}
    self.vocab_size = 1000
    self.special_tokens_map = {"eos_token_id": 69}

  def apply_chat_template(self, conversation, tokenize=True, add_generation_prompt=True, tools=None, **kwargs):
    return "dummy_tokenized_prompt"

  def encode(self, text):
    return np.array([1])

  def decode(self, tokens, skip_special_tokens: bool = False):
    return "dummy" * len(tokens)  # it has no special tokens: every token, its EOS too, reads "dummy" (upstream's CI parity)


def eos_ids(tokenizer) -> Set[int]:
  """The ids that end an answer: ours name them all (eos_token_ids); an upstream-style tokenizer has one eos_token_id."""
  return set(getattr(tokenizer, "eos_token_ids", None) or {tokenizer.eos_token_id})


def _raise(message: str):
  raise ValueError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None, sort_keys: bool = False) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(source: str):
  # The same environment Hugging Face's apply_chat_template uses, so prompts tokenise identically.
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise
  env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
  return env.from_string(source)


class Tokenizer:
  """A `tokenizers.Tokenizer` plus what exo needs: end-of-turn ids and the chat template."""

  def __init__(self, backend, chat_template: Optional[str], bos_token: Optional[str], eos_token: Optional[str],
               eos_token_ids: Iterable[int], add_special_tokens: bool = True):
    self.backend = backend
    self.chat_template = chat_template
    self.bos_token = bos_token
    self.eos_token = eos_token
    self.eos_token_ids = set(int(i) for i in eos_token_ids)
    self.eos_token_id = backend.token_to_id(eos_token) if eos_token is not None else min(self.eos_token_ids)
    self.eos_token_ids.add(self.eos_token_id)
    self.add_special_tokens = add_special_tokens
    self.vocab_size = backend.get_vocab_size()
    self.special_tokens_map = {"bos_token": bos_token, "eos_token": eos_token, "eos_token_id": self.eos_token_id}

  def encode(self, text: str, add_special_tokens: Optional[bool] = None) -> List[int]:
    add = self.add_special_tokens if add_special_tokens is None else add_special_tokens
    # encode_batch lets go of the GIL while it works; encode holds it throughout (seconds for a long prompt, during
    # which no other thread of the process, the event loop's included, can run).
    return self.backend.encode_batch([text], add_special_tokens=add)[0].ids

  def decode(self, tokens: Union[Sequence[int], np.ndarray], skip_special_tokens: bool = False) -> str:
    ids = [int(t) for t in np.asarray(tokens).reshape(-1)]
    return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, conversation: List[Dict[str, Any]], tokenize: bool = False, add_generation_prompt: bool = True,
                          tools: Optional[List[dict]] = None, **kwargs):
    if not self.chat_template:
      raise ValueError("this model declares no chat template")
    text = _compile_template(self.chat_template).render(
      messages=conversation, add_generation_prompt=add_generation_prompt, tools=tools,
      bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
    return self.encode(text, add_special_tokens=False) if tokenize else text


# GGUF token types (llama.cpp): 3 = control, 4 = user-defined; both must match as whole tokens.
_SPECIAL_TOKEN_TYPES = (3, 4)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gguf_field(reader, key: str, default=None):
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def tokenizer_from_gguf(path: Union[str, Path]) -> Tokenizer:
  """Build a byte-level BPE tokenizer from GGUF metadata (tokenizer.ggml.model == "gpt2")."""
  from tokenizers import AddedToken, Regex
  from tokenizers import Tokenizer as HFTokenizer
  from tokenizers import decoders, models, pre_tokenizers

  from exo.inference.weights import gguf_reader
  reader = gguf_reader(str(path))
  kind = _gguf_field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
  tokens: List[str] = _gguf_field(reader, "tokenizer.ggml.tokens")
  types: List[int] = _gguf_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
  merges = [tuple(m.split(" ", 1)) for m in _gguf_field(reader, "tokenizer.ggml.merges")]
  backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
  pre = _gguf_field(reader, "tokenizer.ggml.pre", "default")
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == "llama-bpe":
    backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  elif pre in ("smollm", "starcoder", "refact", "codeshell"):
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  else:
    backend.pre_tokenizer = byte_level
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in _SPECIAL_TOKEN_TYPES])

  bos_id = _gguf_field(reader, "tokenizer.ggml.bos_token_id")
  eos_id = _gguf_field(reader, "tokenizer.ggml.eos_token_id")
  eot_ids = {eos_id} | {_gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")}
  # End-of-turn markers the model declares among its control tokens (e.g. <|im_end|>, <|eot_id|>, <|endoftext|>).
  eot_ids |= {i for i, t in enumerate(tokens) if types[i] == 3 and t in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end_of_text|>")}
  eot_ids.discard(None)
  if _gguf_field(reader, "tokenizer.ggml.add_bos_token", False) and bos_id is not None:
    from tokenizers.processors import TemplateProcessing
    backend.post_processor = TemplateProcessing(single=f"{tokens[bos_id]} $A", special_tokens=[(tokens[bos_id], bos_id)])
  return Tokenizer(backend, _gguf_field(reader, "tokenizer.chat_template"),
                   tokens[bos_id] if bos_id is not None else None, tokens[eos_id] if eos_id is not None else None, eot_ids)


def _token_text(value) -> Optional[str]:
  return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_dir(path: Union[str, Path]) -> Tokenizer:
  """Load tokenizer.json with tokenizer_config.json (template, bos/eos) and generation_config.json (extra EOS ids)."""
  from tokenizers import Tokenizer as HFTokenizer
  path = Path(path)
  backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
  config = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").exists() else {}
  template = config.get("chat_template")
  if isinstance(template, list):  # named templates: use the default one
    template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
  if template is None and (path / "chat_template.jinja").exists():
    template = (path / "chat_template.jinja").read_text()
  if template is None and (path / "chat_template.json").exists():  # an image-and-text model's processor's (Gemma 3 4B and larger)
    template = json.loads((path / "chat_template.json").read_text()).get("chat_template")
  eos_ids = set()
  gen_config = path / "generation_config.json"
  if gen_config.exists():
    eos = json.loads(gen_config.read_text()).get("eos_token_id")
    eos_ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
  eos_token = _token_text(config.get("eos_token"))
  if eos_token is None and not eos_ids:
    raise ValueError(f"{path}: no eos_token in tokenizer_config.json and no eos_token_id in generation_config.json")
  return Tokenizer(backend, template, _token_text(config.get("bos_token")), eos_token, eos_ids)


# Tokenizers somebody holds, by the file they were read from as it is now (path, modification time, size): the API
# and the engine of a node share one per model (SmolLM2's: ~13 MiB) instead of each building its own.
_live_tokenizers: "weakref.WeakValueDictionary[tuple, Tokenizer]" = weakref.WeakValueDictionary()


def resolve_tokenizer(repo_or_path: Union[str, Path]):
  """"dummy" -> DummyTokenizer; a GGUF file (whatever its name) or a directory with tokenizer.json -> Tokenizer
  (the same object for the same unchanged file while anyone holds it: it is not changed after it is built)."""
  if str(repo_or_path) == "dummy":
    return DummyTokenizer()
  path = Path(repo_or_path)
  if is_gguf(path):
    source, build = path, tokenizer_from_gguf
  elif (path / "tokenizer.json").exists():
    source, build = path / "tokenizer.json", tokenizer_from_dir
  else:
    raise ValueError(f"No tokenizer found at {repo_or_path} (expected a .gguf file or a directory with tokenizer.json)")
  stat = source.stat()
  key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
  tokenizer = _live_tokenizers.get(key)
  if tokenizer is None:
    tokenizer = _live_tokenizers[key] = build(path)
  return tokenizer

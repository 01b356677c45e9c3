"""A model's weights for one shard, from a GGUF file or a Hugging Face / MLX directory, as float32 numpy arrays.

Every engine reads its weights through `load_shard_weights`, so they all see the same tensors under the same
(Hugging Face) names, in Hugging Face orientation (out_features, in_features) and rotate-half RoPE layout. MLX
quantized checkpoints and GGUF's 4- to 8-bit tensors (gguf_quants.py) are dequantised, or kept packed
(exo/inference/quantized.py) for an engine that runs them, as are gpt-oss's MXFP4 experts; GGUF's other types are
always dequantised."""
import json
import re
import weakref
from functools import lru_cache
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import numpy as np

from exo.inference.gguf_header import ARCHITECTURES as GGUF_ARCHITECTURES, is_gguf
from exo.inference.gguf_quants import GGUF_AFFINE_TYPES, from_gguf_blocks
from exo.inference.models import ModelConfig, UnsupportedModel, model_config
from exo.inference.quantize import quantize as quantize_matrix, quantizes
from exo.inference.models.gemma3 import text_weight_name
from exo.inference.quantized import QuantizedWeight, group_mxfp4_blocks, group_quantized, take_rows
from exo.inference.shard import Shard


LlamaConfig = ModelConfig  # the name engines and tests have used; every family shares it


def _layer_index(name: str) -> Optional[int]:
  match = re.match(r"(?:model\.layers|blk)\.(\d+)\.", name)
  return int(match.group(1)) if match else None


def _wanted(name: str, shard: Shard, tied: bool) -> bool:
  layer = _layer_index(name)
  if layer is not None:
    return shard.start_layer <= layer <= shard.end_layer
  if name.startswith(("model.embed_tokens.", "token_embd.")):  # .weight, and .scales/.biases when quantized
    return shard.is_first_layer() or (tied and shard.is_last_layer())
  return shard.is_last_layer()  # final norm, lm_head


# GGUF name -> Hugging Face name
_GGUF_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight",
  "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
  "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
  "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def _hf_name(gguf_name: str) -> Optional[str]:
  if gguf_name in _GGUF_NAMES:
    return _GGUF_NAMES[gguf_name]
  match = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", gguf_name)
  if match and match.group(2) in _GGUF_NAMES:
    return f"model.layers.{match.group(1)}.{_GGUF_NAMES[match.group(2)]}.{match.group(3)}"
  return None


def _unpermute_rope(w: Union[np.ndarray, QuantizedWeight], n_heads: int) -> Union[np.ndarray, QuantizedWeight]:
  """llama.cpp stores Q/K with RoPE pairs interleaved; undo that to Hugging Face's rotate-half layout. Whole rows
  move, so a quantized matrix's rows move with their scales."""
  if isinstance(w, QuantizedWeight):
    return take_rows(w, _unpermute_rope(np.arange(w.shape[0])[:, None], n_heads)[:, 0])
  out_features = w.shape[0]
  return w.reshape(n_heads, out_features // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def gguf_config(reader) -> LlamaConfig:
  def get(key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()
  arch = get("general.architecture")
  if arch not in GGUF_ARCHITECTURES:
    raise UnsupportedModel("general.architecture", f"GGUF architecture {arch!r} is not supported (only {', '.join(map(repr, GGUF_ARCHITECTURES))})")
  hidden = get("llama.embedding_length")
  n_heads = get("llama.attention.head_count")
  vocab = get("llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
  names = {t.name for t in reader.tensors}
  config = LlamaConfig(
    hidden_size=hidden, intermediate_size=get("llama.feed_forward_length"), n_layers=get("llama.block_count"),
    n_heads=n_heads, n_kv_heads=get("llama.attention.head_count_kv", n_heads), vocab_size=vocab,
    head_dim=get("llama.attention.key_length", hidden // n_heads), rms_norm_eps=get("llama.attention.layer_norm_rms_epsilon", 1e-5),
    rope_theta=get("llama.rope.freq_base", 10000.0), tie_word_embeddings="output.weight" not in names,
    max_position_embeddings=get("llama.context_length", 4096))
  return config


# Readers somebody still holds, by path: a load's weights and tokenizer share one parse. Nothing keeps one beyond its
# users: a parse holds ~45 MiB of small arrays for SmolLM2's vocabulary and merges (and the file's pages it read),
# which a cache kept for the node's life once the API had read a model's config after the load.
_live_readers: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


def gguf_reader(path: Union[str, Path]):
  """The file's metadata and tensors, parsed once while any caller holds the result."""
  path = str(Path(path).resolve())  # a link (a Hugging Face snapshot's, say) and its file share the parse
  reader = _live_readers.get(path)
  if reader is None:
    reader = _live_readers[path] = _parse_gguf(path)
  return reader


def _parse_gguf(path: str):
  import gguf

  class FastGGUFReader(gguf.GGUFReader):
    """gguf's reader, reading its fields from a plain array over the file's mapping. It slices the file once per
    metadata part (about 250,000 times for SmolLM2's vocabulary and merges), and a slice of a memmap costs several
    times a plain array's (memmap.__array_finalize__), so parsing took 5-16 s a process, now about 1."""
    dtypes: Dict[tuple, np.dtype] = {}

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
      if type(self.data) is not np.ndarray:
        self.data = self.data.view(np.ndarray)  # same pages; the mapping stays alive as the view's base
      order = self.byte_order if override_order is None else override_order
      typed = self.dtypes.get((dtype, order))
      if typed is None:
        typed = self.dtypes[(dtype, order)] = np.dtype(dtype).newbyteorder(order)
      return self.data[offset:offset + typed.itemsize * int(count)].view(typed)

  return FastGGUFReader(path)


FLOAT_GGUF_TYPES = ("F32", "F16", "BF16")


def load_gguf(path: Union[str, Path], shard: Shard, keep_quantized: bool = False, quantize: Optional[int] = None) -> Tuple[LlamaConfig, Dict[str, np.ndarray]]:
  import gguf
  reader = gguf_reader(str(path))
  config = gguf_config(reader)
  weights: Dict[str, np.ndarray] = {}
  for tensor in reader.tensors:
    if tensor.name == "rope_freqs.weight":
      freq_factors = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(-1)
      config = LlamaConfig(**{**config.__dict__, "rope_scaling": {"freq_factors": freq_factors.tolist()}})
      continue
    name = _hf_name(tensor.name)
    if name is None or not _wanted(name, shard, config.tie_word_embeddings):
      continue
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
    if keep_quantized and tensor.tensor_type.name in GGUF_AFFINE_TYPES and len(shape) == 2:
      w = from_gguf_blocks(tensor.data, tensor.tensor_type.name, shape[0])
    else:
      w = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32).reshape(shape))
      if quantize and tensor.tensor_type.name in FLOAT_GGUF_TYPES and quantizes(name, shape):
        w = quantize_matrix(w, quantize)
    if name.endswith("q_proj.weight"):
      w = _unpermute_rope(w, config.n_heads)
    elif name.endswith("k_proj.weight"):
      w = _unpermute_rope(w, config.n_kv_heads)
    weights[name] = w
  return config, weights


def hf_config(config_json: dict) -> LlamaConfig:
  """The model a config.json describes, in either transformers form; UnsupportedModel (a ValueError) naming the
  field when it needs math no engine here computes."""
  return model_config(config_json)


def load_hf_dir(path: Union[str, Path], shard: Shard, keep_quantized: bool = False, quantize: Optional[int] = None) -> Tuple[LlamaConfig, Dict[str, np.ndarray]]:
  """config.json + *.safetensors (with or without model.safetensors.index.json); opens only files holding our tensors."""
  path = Path(path)
  config_json = json.loads((path / "config.json").read_text())
  config = hf_config(config_json)
  index = path / "model.safetensors.index.json"
  if index.exists():
    weight_map: Dict[str, str] = json.loads(index.read_text())["weight_map"]
  else:
    weight_map = {name: file.name for file in sorted(path.glob("*.safetensors")) for name in _safetensors_header(file)[0] if name != "__metadata__"}
  wanted: Dict[str, list] = {}
  text_names: Dict[str, str] = {}  # stored name -> the text model's (a multimodal checkpoint's language model; no vision parts)
  for stored, file in weight_map.items():
    name = text_weight_name(stored)
    if name is not None and _wanted(name, shard, config.tie_word_embeddings) and not name.endswith("rotary_emb.inv_freq"):
      wanted.setdefault(file, []).append(stored)
      text_names[stored] = name
  weights: Dict[str, np.ndarray] = {}
  convert = None if not quantize else lambda name, w: quantize_matrix(w, quantize) if quantizes(text_names[name], w.shape) else w
  for file, names in wanted.items():
    weights.update(_read_safetensors(path / file, names, convert))
  # grouped under the stored names, which a quantization config's per-layer settings use
  weights = group_quantized(weights, config_json.get("quantization") or config_json.get("quantization_config"))
  weights = group_mxfp4_blocks({text_names[stored]: w for stored, w in weights.items()})
  if not keep_quantized:
    weights = {name: w.dequantize() if isinstance(w, QuantizedWeight) else w for name, w in weights.items()}
  return config, weights


def _safetensors_header(file: Path) -> Tuple[dict, int]:
  """The header (tensor name -> dtype, shape, offsets) and where the data starts."""
  with open(file, "rb") as f:
    header_len = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(header_len)), 8 + header_len


def _read_safetensors(file: Path, names, convert=None) -> Dict[str, np.ndarray]:
  """Selected tensors, read directly (only our layers): floats as float32 (numpy has no bfloat16), or as
  convert(name, float32 array) gives them, one at a time; integers (quantized codes and exponents) as stored."""
  header, base = _safetensors_header(file)
  dtypes = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "U32": np.uint32, "U8": np.uint8, "I32": np.int32}
  out = {}
  with open(file, "rb") as f:
    for name in names:
      meta = header[name]
      start, end = meta["data_offsets"]
      f.seek(base + start)
      dtype = np.dtype(dtypes[meta["dtype"]])
      raw = np.fromfile(f, dtype=dtype, count=(end - start) // dtype.itemsize).reshape(meta["shape"])  # writable, one copy
      if meta["dtype"] == "BF16":
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
      is_float = meta["dtype"] in ("F32", "F16", "BF16", "F64")
      out[name] = np.ascontiguousarray(raw, dtype=np.float32 if is_float else raw.dtype)
      del raw
      if is_float and convert is not None:
        out[name] = convert(name, out[name])
  return out


def load_shard_weights(model_path: Union[str, Path], shard: Shard, keep_quantized: bool = False,
                       quantize: Optional[int] = None) -> Tuple[LlamaConfig, Dict[str, np.ndarray]]:
  """The shard's own layers (plus embeddings on the first shard, final norm and head on the last). With
  keep_quantized, a quantized matrix (MLX, or GGUF's types in gguf_quants.py) comes as a QuantizedWeight instead of
  float32; with `quantize` (4 or 8, only for an engine that keeps them so), float matrices are quantized as they load."""
  model_path = Path(model_path)
  if quantize and not keep_quantized:
    raise ValueError("quantizing on load needs an engine that keeps weights quantized (numpy or mlx)")
  if is_gguf(model_path):
    return load_gguf(model_path, shard, keep_quantized, quantize)
  if model_path.is_dir() and (model_path / "config.json").exists():
    return load_hf_dir(model_path, shard, keep_quantized, quantize)
  raise ValueError(f"{model_path}: neither a GGUF file nor a directory with config.json")


def load_config(model_path: Union[str, Path]) -> LlamaConfig:
  """The model's configuration alone, without its weights (GGUF metadata, or config.json)."""
  model_path = Path(model_path)
  if is_gguf(model_path):
    stat = model_path.stat()
    return _gguf_file_config(str(model_path.resolve()), stat.st_mtime_ns, stat.st_size)
  return hf_config(json.loads((model_path / "config.json").read_text()))


@lru_cache(maxsize=64)
def _gguf_file_config(path: str, mtime_ns: int, size: int) -> LlamaConfig:
  """A GGUF's configuration, kept (small and frozen) where the reader it came from is not; a file changed in place
  (another modification time or size) is read again."""
  return gguf_config(gguf_reader(path))

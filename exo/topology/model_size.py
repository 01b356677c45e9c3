"""What a model's pieces weigh, for placement: the weights of one layer, of the embedding and of the output head, and
the KV cache a layer keeps per position, each at the precision a node's engine holds them in.

Every node must size a model the same way (placement is derived on each node from the same facts), so the figures
come from the model's shape, which is the same wherever it is read: a table for the registry's models, the
checkpoint's own config for a local checkpoint. A model whose shape is unknown has no size (placement then puts it
on one pipeline over every node, as exo always did)."""
import functools
import os
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from exo.inference.gguf_header import is_gguf
from exo.models import get_repo, model_cards

KV_RESERVE_POSITIONS = 16384  # KV positions a copy of a model keeps room for: KV_RESERVE_STREAMS streams of 1,024 positions
KV_RESERVE_STREAMS = 16


@dataclass(frozen=True)
class ModelShape:
  hidden: int
  intermediate: int
  vocab: int
  kv_dim: int  # key/value heads x head dimension
  tied: bool  # the output head is the embedding's matrix
  q_dim: int = 0  # query heads x head dimension, where it differs from hidden (0: hidden)
  # One layer's weights, on average over the layers, where the config gives them exactly (a checkpoint's: latent
  # attention's projections, every expert, shared experts and dense layers as the model has them); 0: from the above
  layer_total: int = 0
  window: int = 0  # the sliding layers' window (0: no layer slides)
  sliding_layers: Tuple[int, ...] = ()

  @property
  def layer_weights(self) -> int:
    """Attention (q and o hidden x q_dim, k and v hidden x kv_dim), the gated MLP's three matrices, two norms."""
    if self.layer_total:
      return self.layer_total
    h = self.hidden
    return 2 * h * (self.q_dim or h) + 2 * h * self.kv_dim + 3 * h * self.intermediate + 2 * h

  def kv_reserve(self, start: int, end: int, keeps_window: bool = True) -> int:
    """Elements the KV caches of layers start..end keep room for: KV_RESERVE_POSITIONS positions a layer, in
    KV_RESERVE_STREAMS streams, of which a sliding layer holds at most its window each (where the engine's cache
    `keeps_window`: KEEPS_WINDOW)."""
    sliding = sum(1 for layer in self.sliding_layers if start <= layer <= end) if self.window and keeps_window else 0
    stream = KV_RESERVE_POSITIONS // KV_RESERVE_STREAMS
    positions = (end - start + 1 - sliding) * KV_RESERVE_POSITIONS + sliding * KV_RESERVE_STREAMS * min(stream, self.window)
    return positions * self.kv_per_position

  @property
  def head_weights(self) -> int:
    """The output head (vocab x hidden) and the final norm: every row's logits cost one product with it."""
    return self.vocab * self.hidden + self.hidden

  @property
  def embedding_weights(self) -> int:
    return self.vocab * self.hidden

  @property
  def kv_per_position(self) -> int:
    """Elements one layer's KV cache keeps per position (a key and a value)."""
    return 2 * self.kv_dim


# The registry's models (hidden, MLP, vocabulary, KV width, tied head), as their configs give them.
SHAPES = {
  "smollm2-135m": ModelShape(576, 1536, 49152, 3 * 64, True),
  "llama-3.2-1b": ModelShape(2048, 8192, 128256, 8 * 64, True),
  "llama-3.2-3b": ModelShape(3072, 8192, 128256, 8 * 128, True),
  "llama-3.1-8b": ModelShape(4096, 14336, 128256, 8 * 128, False),
  "llama-3.1-70b": ModelShape(8192, 28672, 128256, 8 * 128, False),
  "llama-3.1-405b": ModelShape(16384, 53248, 128256, 8 * 128, False),
  "dummy": ModelShape(1, 1, 1000, 1, True),
}
SHAPES.update({
  "llama-3.2-1b-8bit": SHAPES["llama-3.2-1b"], "llama-3.2-3b-8bit": SHAPES["llama-3.2-3b"], "llama-3.2-3b-bf16": SHAPES["llama-3.2-3b"],
  "llama-3-8b": SHAPES["llama-3.1-8b"], "llama-3.3-70b": SHAPES["llama-3.1-70b"], "llama-3.1-70b-bf16": SHAPES["llama-3.1-70b"],
  "llama-3-70b": SHAPES["llama-3.1-70b"], "llama-3.1-405b-8bit": SHAPES["llama-3.1-405b"],
})

# The other families (hidden, MLP, vocabulary, KV width, tied head, query width). A mixture of experts' MLP width is
# every expert's together (a node holds them all); Gemma 3 4B and larger: the text model's (the vision tower is not
# loaded). Each weighs what its model is published at, within 10 per cent (tests/test_placement.py).
QWEN25 = {"0.5b": ModelShape(896, 4864, 151936, 2 * 64, True), "1.5b": ModelShape(1536, 8960, 151936, 2 * 128, True),
          "3b": ModelShape(2048, 11008, 151936, 2 * 128, True), "7b": ModelShape(3584, 18944, 152064, 4 * 128, False),
          "14b": ModelShape(5120, 13824, 152064, 8 * 128, False), "32b": ModelShape(5120, 27648, 152064, 8 * 128, False),
          "72b": ModelShape(8192, 29568, 152064, 8 * 128, False)}
SHAPES.update({f"qwen-2.5-{size}": shape for size, shape in QWEN25.items()})
SHAPES.update({f"qwen-2.5-coder-{size}": QWEN25[size] for size in ("0.5b", "1.5b", "3b", "7b", "14b", "32b")})
SHAPES.update({f"qwen-2.5-math-{size}": QWEN25[size] for size in ("1.5b", "7b", "72b")})
SHAPES.update({f"deepseek-r1-distill-qwen-{size}": QWEN25[size] for size in ("7b", "14b", "32b")})
SHAPES.update({"deepseek-r1-distill-llama-8b": SHAPES["llama-3.1-8b"], "deepseek-r1-distill-llama-70b": SHAPES["llama-3.1-70b"]})
SHAPES.update({
  "qwen-3-0.6b": ModelShape(1024, 3072, 151936, 8 * 128, True, 16 * 128), "qwen-3-1.7b": ModelShape(2048, 6144, 151936, 8 * 128, True),
  "qwen-3-4b": ModelShape(2560, 9728, 151936, 8 * 128, True, 32 * 128), "qwen-3-8b": ModelShape(4096, 12288, 151936, 8 * 128, False),
  "qwen-3-14b": ModelShape(5120, 17408, 151936, 8 * 128, False), "qwen-3-32b": ModelShape(5120, 25600, 151936, 8 * 128, False, 64 * 128),
  "qwen-3-30b-a3b": ModelShape(2048, 128 * 768, 151936, 4 * 128, False, 32 * 128),
  "qwen-3-235b-a22b": ModelShape(4096, 128 * 1536, 151936, 4 * 128, False, 64 * 128),
  "gpt-oss-20b": ModelShape(2880, 32 * 2880, 201088, 8 * 64, False, 64 * 64),
  "gpt-oss-120b": ModelShape(2880, 128 * 2880, 201088, 8 * 64, False, 64 * 64),
  "mistral-7b": ModelShape(4096, 14336, 32768, 8 * 128, False), "mistral-nemo": ModelShape(5120, 14336, 131072, 8 * 128, False, 32 * 128),
  "mistral-small-24b": ModelShape(5120, 32768, 131072, 8 * 128, False, 32 * 128),
  "gemma-2-2b": ModelShape(2304, 9216, 256000, 4 * 256, True, 8 * 256), "gemma-2-9b": ModelShape(3584, 14336, 256000, 8 * 256, True, 16 * 256),
  "gemma-2-27b": ModelShape(4608, 36864, 256000, 16 * 128, True, 32 * 128),
  "gemma-3-1b": ModelShape(1152, 6912, 262144, 1 * 256, True, 4 * 256), "gemma-3-4b": ModelShape(2560, 10240, 262208, 4 * 256, True, 8 * 256),
  "gemma-3-12b": ModelShape(3840, 15360, 262208, 8 * 256, True, 16 * 256),
  "gemma-3-27b": ModelShape(5376, 21504, 262208, 16 * 128, True, 32 * 128),
  "phi-4": ModelShape(5120, 17920, 100352, 10 * 128, False),
  "granite-3.1-2b": ModelShape(2048, 8192, 49155, 8 * 64, True), "granite-3.1-8b": ModelShape(4096, 12800, 49155, 8 * 128, True),
  "olmo-2-7b": ModelShape(4096, 11008, 100352, 32 * 128, False), "olmo-2-13b": ModelShape(5120, 13824, 100352, 40 * 128, False),
})


def sliding(shape: ModelShape, model_id: str, window: int, full_every: int) -> ModelShape:
  """The shape with every layer of the card's but each `full_every`-th sliding over `window` positions (Gemma 2 and
  gpt-oss: every other; Gemma 3: five of six)."""
  layers = model_cards[model_id]["layers"]
  return replace(shape, window=window, sliding_layers=tuple(i for i in range(layers) if (i + 1) % full_every))


for model_id, window, full_every in [("gpt-oss-20b", 128, 2), ("gpt-oss-120b", 128, 2), ("gemma-2-2b", 4096, 2), ("gemma-2-9b", 4096, 2),
                                     ("gemma-2-27b", 4096, 2), ("gemma-3-1b", 512, 6), ("gemma-3-4b", 1024, 6), ("gemma-3-12b", 1024, 6),
                                     ("gemma-3-27b", 1024, 6)]:
  SHAPES[model_id] = sliding(SHAPES[model_id], model_id, window, full_every)


def shape_of(model_id: str) -> Optional[ModelShape]:
  """The model's shape: the table's, or a local checkpoint's own config; None when neither is known."""
  if model_id in SHAPES:
    return SHAPES[model_id]
  path = model_cards.get(model_id, {}).get("path")  # a local checkpoint's (registered as it is served)
  if path is None and isinstance(model_id, str) and os.path.isabs(model_id):
    path = model_id
  return _checkpoint_shape(path) if path is not None else None


@functools.lru_cache(maxsize=64)
def _checkpoint_shape(path: str) -> Optional[ModelShape]:
  from exo.inference.weights import load_config
  try:
    c = load_config(path)
  except (OSError, ValueError, KeyError):
    return None
  # the MLP width that weighs what the layers' MLPs do on average: a mixture of experts' every expert counts
  intermediate = c.mlp_parameters() // (3 * c.hidden_size * c.n_layers)
  # the KV width as the cache holds it: half of a position's values (a key and a value each; MLA's latent and RoPE key)
  q_dim = 0 if c.latent_attention else c.n_heads * c.head_dim
  # each layer's weights as the model has them, averaged over the layers
  layer_total = -(-c.layer_parameters() // c.n_layers)
  return ModelShape(c.hidden_size, intermediate, c.vocab_size, -(-c.kv_values_per_position // 2), c.tie_word_embeddings, q_dim,
                    layer_total, c.sliding_window or 0, c.sliding_layers if c.sliding_window else ())


# Bytes a weight of each GGUF type takes held quantized (exo/inference/gguf_quants.py: 16-bit scale and bias a block
# of 32 for the simple types; K-quants with float32 scales and biases, 5- and 6-bit codes one a byte).
GGUF_HELD_BYTES = {"Q4_0": 20 / 32, "Q4_1": 20 / 32, "Q8_0": 36 / 32, "Q4_K": 0.75, "Q5_K": 1.25, "Q6_K": 1.5}
KEEPS_QUANTIZED = ("NumpyDynamicShardInferenceEngine", "MLXDynamicShardInferenceEngine")
KEEPS_WINDOW = ("NumpyDynamicShardInferenceEngine", "MLXDynamicShardInferenceEngine")  # their kv_keeps_window


@functools.lru_cache(maxsize=64)
def _checkpoint_weight_bytes(repo: str, float_bytes: float) -> Optional[float]:
  """Bytes a weight of a checkpoint on this machine (a local path, or the embedded model) takes held as an engine that
  keeps quantized weights holds it, averaged over its matrices; None for a checkpoint not here or not quantized."""
  from exo.download.shard_files import local_model_path
  path = local_model_path(repo)
  if path is None or not path.exists():
    return None
  try:
    if is_gguf(path):
      from exo.inference.weights import gguf_reader
      matrices = [(int(t.n_elements), t.tensor_type.name) for t in gguf_reader(str(path)).tensors if len(t.shape) == 2]
    else:
      matrices = _safetensors_matrices(path)
  except (OSError, ValueError, KeyError):
    return None
  count = sum(n for n, _ in matrices)
  held = sum(n * (float_bytes if kind is None else GGUF_HELD_BYTES.get(kind, float_bytes) if isinstance(kind, str) else kind) for n, kind in matrices)
  return held / count if count and held < count * float_bytes else None


# An MXFP4 weight (gpt-oss's experts), as numpy and MLX hold it: its 4-bit code and a byte's exponent a block of 32.
MXFP4_HELD_BYTES = 0.5 + 1 / 32


def _safetensors_matrices(path) -> list:
  """(weights, bytes a weight held) of each quantized matrix of a Hugging Face / MLX directory, from the safetensors
  headers alone (mlx-lm's stacked experts and per-layer overrides included), and (weights, None) of each float one."""
  import json
  import math
  from exo.inference.quantized import layer_format
  from exo.inference.weights import _safetensors_header
  config = json.loads((path / "config.json").read_text())
  quantization = config.get("quantization") or {}
  headers = {}
  for file in sorted(path.glob("*.safetensors")):
    headers.update({name: meta for name, meta in _safetensors_header(file)[0].items() if name != "__metadata__"})
  matrices = []
  for name, meta in headers.items():
    elements = math.prod(meta["shape"])
    if len(meta["shape"]) < 2 or name.endswith((".scales", ".biases", "_scales")):
      continue  # vectors; a quantized matrix's scales and biases are counted with it
    if name.endswith("_blocks"):
      matrices.append((2 * elements, MXFP4_HELD_BYTES))
    elif meta["dtype"] == "U32" and name.endswith(".weight") and name[:-len("weight")] + "scales" in headers:
      layer = layer_format(quantization, name[:-len(".weight")])
      # affine: a 16-bit scale and bias a group; the mx modes: a byte's exponent
      matrices.append((elements * 32 // layer["bits"], layer["bits"] / 8 + (4 if layer["mode"] == "affine" else 1) / layer["group_size"]))
    else:
      matrices.append((elements, None))
  return matrices


def _mxfp4_experts_weight_bytes(model_id: str, float_bytes: float) -> Optional[float]:
  """A card whose experts come in MXFP4 and everything else in float, not yet on this machine: bytes a weight
  averaged over the whole model, from its shape (ModelShape.intermediate counts every expert's width)."""
  shape, layers = SHAPES.get(model_id), model_cards[model_id]["layers"]
  if shape is None:
    return None
  experts = layers * 3 * shape.hidden * shape.intermediate
  total = layers * shape.layer_weights + shape.embedding_weights + (0 if shape.tied else shape.head_weights)
  return (experts * MXFP4_HELD_BYTES + (total - experts) * float_bytes) / total


def weight_bytes(engine_classname: str, float_bytes: float, model_id: str) -> float:
  """Bytes one weight takes on a node: the numpy and MLX engines hold quantized checkpoints as they are (4 or 8 bits
  and a scale and bias a group); other weights are held at the engine's float width; the dummy engine holds nothing."""
  if engine_classname == "DummyInferenceEngine":
    return 0.0
  if engine_classname in KEEPS_QUANTIZED:
    held = _checkpoint_weight_bytes(get_repo(model_id, engine_classname) or "", float(float_bytes))
    if held is None and model_cards.get(model_id, {}).get("mxfp4_experts"):
      held = _mxfp4_experts_weight_bytes(model_id, float(float_bytes))
    if held is not None:
      return held
  if engine_classname == "MLXDynamicShardInferenceEngine":
    repo = (get_repo(model_id, engine_classname) or "").lower()
    for bits in (3, 4, 6, 8):
      if f"{bits}bit" in repo:
        return bits / 8 + 4 / 64
  return float(float_bytes)


def kv_value_bytes(engine_classname: str, float_bytes: int) -> int:
  """Bytes a cached key or value element takes on a node of this engine and float width: every engine keeps its cache
  at the width it computes in. (A numpy node started with EXO_KV_BITS=16 keeps half; its peers are not told, so its
  reserve is counted at float32: room to spare, never too little.)"""
  return float_bytes


def engine_float_bytes(engine_name: str) -> int:
  """The float width (bytes) an engine computes and keeps KV caches in on this machine."""
  if engine_name == "dummy":
    return 0
  if engine_name == "mlx":
    return 2
  if engine_name == "tinygrad":
    from exo.inference.tinygrad.llama import float_dtype
    return float_dtype()(0).itemsize
  return 4

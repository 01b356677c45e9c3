"""BERT, the encoder, in float32 numpy: token ids in, one hidden state per token out (as Hugging Face's BertModel's
last_hidden_state). Sentence embedding models (all-MiniLM-L6-v2) pool these; see exo/embeddings/model.py.

A batch is a padded (rows, length) matrix of ids with a mask marking the real tokens: padding keys are masked out
of attention, so a row's states do not depend on what it is batched with."""
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from exo.inference.numpy.kernels import Workers, matmul

MASKED = np.float32(-1e30)  # a padding key's score: exp() of it minus the row's max is 0


@dataclass(frozen=True)
class BertConfig:
  hidden_size: int
  layers: int
  heads: int
  intermediate_size: int
  vocab_size: int
  max_positions: int
  type_vocab_size: int
  layer_norm_eps: float

  @classmethod
  def from_json(cls, config: dict) -> "BertConfig":
    if config.get("model_type") != "bert" or config.get("hidden_act", "gelu") != "gelu" or config.get("position_embedding_type", "absolute") != "absolute":
      raise ValueError(f"not a BERT encoder this engine runs (model_type {config.get('model_type')!r}, hidden_act {config.get('hidden_act')!r}, "
                       f"position_embedding_type {config.get('position_embedding_type')!r})")
    return cls(config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"], config["intermediate_size"], config["vocab_size"],
               config["max_position_embeddings"], config.get("type_vocab_size", 2), config.get("layer_norm_eps", 1e-12))


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
  mean = x.mean(-1, keepdims=True)
  centred = x - mean
  variance = np.mean(centred * centred, -1, keepdims=True)
  return centred / np.sqrt(variance + eps) * weight + bias


def erf(x: np.ndarray) -> np.ndarray:
  """Abramowitz and Stegun 7.1.26 (error below 1.5e-7, under float32's resolution of gelu's output); numpy has no erf."""
  sign = np.sign(x)
  a = np.abs(x)
  t = 1.0 / (1.0 + 0.3275911 * a)
  poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
  return sign * (1.0 - poly * np.exp(-a * a))


def gelu(x: np.ndarray) -> np.ndarray:
  """The exact (erf) GELU, BERT's `gelu`, not the tanh approximation."""
  return (0.5 * x * (1.0 + erf(x * np.float32(0.7071067811865476)))).astype(np.float32, copy=False)


class Bert:
  def __init__(self, config: BertConfig, weights: Dict[str, np.ndarray]):
    self.config = config
    prefix = "bert." if "bert.embeddings.word_embeddings.weight" in weights else ""

    def get(name: str) -> np.ndarray:
      return np.ascontiguousarray(weights[prefix + name], dtype=np.float32)

    def linear(name: str):
      # Kept as (in, out): `matmul` (kernels.py) takes that layout.
      return np.ascontiguousarray(get(f"{name}.weight").T), get(f"{name}.bias")
    self.word, self.position, self.token_type = (get(f"embeddings.{n}_embeddings.weight") for n in ("word", "position", "token_type"))
    self.embed_norm = get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias")
    self.layers = []
    for i in range(config.layers):
      p = f"encoder.layer.{i}."
      q, k, v = (linear(p + f"attention.self.{n}") for n in ("query", "key", "value"))
      self.layers.append({
        "qkv": (np.ascontiguousarray(np.concatenate([q[0], k[0], v[0]], axis=1)), np.concatenate([q[1], k[1], v[1]])),
        "out": linear(p + "attention.output.dense"), "attn_norm": (get(p + "attention.output.LayerNorm.weight"), get(p + "attention.output.LayerNorm.bias")),
        "up": linear(p + "intermediate.dense"), "down": linear(p + "output.dense"),
        "ffn_norm": (get(p + "output.LayerNorm.weight"), get(p + "output.LayerNorm.bias")),
      })

  def __call__(self, ids: np.ndarray, mask: np.ndarray, workers: Optional[Workers] = None) -> np.ndarray:
    """ids and mask (rows, length), mask 1 for a token and 0 for padding: the last layer's states (rows, length, hidden).
    The products are shared among `workers` (kernels.py; the engine's shared ones by default)."""
    c = self.config
    rows, length = ids.shape
    if length > c.max_positions:
      raise ValueError(f"{length} tokens is more than this model's {c.max_positions} positions")
    x = self.word[ids] + self.position[:length][None] + self.token_type[0]
    x = layer_norm(x, *self.embed_norm, c.layer_norm_eps).reshape(rows * length, c.hidden_size)
    bias = np.where(mask[:, None, None, :] > 0, np.float32(0), MASKED).astype(np.float32)
    for layer in self.layers:
      x = layer_norm(x + self._attention(x, layer, rows, length, bias, workers), *layer["attn_norm"], c.layer_norm_eps)
      hidden = matmul(x, *layer["up"], workers, gelu)
      x = layer_norm(x + matmul(hidden, *layer["down"], workers), *layer["ffn_norm"], c.layer_norm_eps)
    return x.reshape(rows, length, c.hidden_size)

  def _attention(self, x: np.ndarray, layer: dict, rows: int, length: int, bias: np.ndarray, workers: Optional[Workers]) -> np.ndarray:
    c = self.config
    head_dim = c.hidden_size // c.heads
    qkv = matmul(x, *layer["qkv"], workers).reshape(rows, length, 3, c.heads, head_dim).transpose(2, 0, 3, 1, 4)  # (3, rows, heads, length, head_dim)
    q, k, v = qkv[0], qkv[1], qkv[2]
    scores = q @ k.transpose(0, 1, 3, 2) * np.float32(1 / np.sqrt(head_dim)) + bias
    scores -= scores.max(-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(-1, keepdims=True)
    out = (scores @ v).transpose(0, 2, 1, 3).reshape(rows * length, c.hidden_size)
    return matmul(np.ascontiguousarray(out), *layer["out"], workers)

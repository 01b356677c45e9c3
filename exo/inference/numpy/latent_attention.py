"""Multi-head latent attention (DeepSeek V2/V3) in numpy, computed in the latent space, as the cache holds it.

A head's key is its `nope` part kv_b_k @ latent beside a RoPE part all heads share, and its value kv_b_v @ latent.
So a query's product with a key is (q_nope @ kv_b_k) . latent + q_rope . k_rope, and the weighted sum of values is
kv_b_v @ (the weighted sum of latents): every head attends over the same cached (latent, k_rope) rows, one KV head
whose keys are their own values, and only the heads' queries and outputs pass through kv_b. The cache thus holds
kv_lora_rank + qk_rope_head_dim values per position and layer, which is what attention reads, instead of the heads'
keys and values it would otherwise expand every step.

kv_b's two halves are per-head matrices (LatentAttentionWeights.embed_q, unembed_out): float, a batched product over
the heads; quantized (mlx-lm's conversions), kept so, one product a head."""
from typing import Callable, Optional

import numpy as np

from exo.inference.llama_layout import LatentAttentionWeights
from exo.inference.models.config import rope_attention_factor
from exo.inference.numpy.kernels import full_product as full, weight_matrix
from exo.inference.quantized import QuantizedWeight
from exo.inference.weights import LlamaConfig


class LatentAttention:
  """One layer's matrices, as the engine computes with them."""

  def __init__(self, weights: LatentAttentionWeights, config: LlamaConfig):
    c = config
    self.q_a = None if weights.q_a is None else weight_matrix(weights.q_a)
    self.q_a_norm, self.kv_a_norm = weights.q_a_norm, weights.kv_a_norm
    self.q_b, self.kv_a = weight_matrix(weights.q_b), weight_matrix(weights.kv_a)
    self.key_up = per_head(weights.embed_q)  # a query's nope part into the latent space
    self.value_up = per_head(weights.unembed_out)  # an output out of it


def per_head(w):
  """(heads, out, in) as heads_product takes it: float (heads, in, out), or each head's matrix kept quantized."""
  if isinstance(w, QuantizedWeight):
    return [weight_matrix(w[h]) for h in range(len(w))]
  return np.ascontiguousarray(np.asarray(w).transpose(0, 2, 1))


def heads_product(x: np.ndarray, w) -> np.ndarray:
  """x (heads, rows, in) through each head's own matrix: (heads, rows, out)."""
  if isinstance(w, np.ndarray):
    return np.matmul(x, w)
  return np.stack([full(x[h], m) for h, m in enumerate(w)])


def latent_attention(x: np.ndarray, layer: LatentAttention, li: int, step, config: LlamaConfig, cos: np.ndarray, sin: np.ndarray,
                     window: Optional[int], rms_norm: Callable, rope: Callable, attend: Callable) -> np.ndarray:
  """Layer li's attention of the step's rows x (rows, hidden), before the output projection: (rows, heads * v).
  The rows' (latent, k_rope) go into the cache first; `attend(q, out)` runs the step's attention jobs with one KV
  head over it."""
  c = config
  rows, n_heads, nope, latent_rank = len(x), c.n_heads, c.qk_nope_head_dim, c.kv_lora_rank
  scale = np.float32(c.attention_scale)
  queries = full(x, layer.q_b) if layer.q_a is None else full(rms_norm(full(x, layer.q_a), layer.q_a_norm, c.rms_norm_eps), layer.q_b)
  queries = queries.reshape(rows, n_heads, nope + c.qk_rope_head_dim)
  compressed = full(x, layer.kv_a)
  entry = np.empty((rows, latent_rank + c.qk_rope_head_dim), dtype=np.float32)
  entry[:, :latent_rank] = rms_norm(compressed[:, :latent_rank], layer.kv_a_norm, c.rms_norm_eps)
  entry[:, latent_rank:] = rope(compressed[:, None, latent_rank:], cos, sin)[:, 0]
  for slab, row_range, slots, positions in step.writes:
    slab[slots, li, 0, 0, positions] = entry[row_range]
  q = np.empty((rows, n_heads, latent_rank + c.qk_rope_head_dim), dtype=np.float32)
  q[..., :latent_rank] = heads_product(queries[..., :nope].transpose(1, 0, 2), layer.key_up).transpose(1, 0, 2) * scale
  # yarn's cos and sin factor turns only the RoPE part: its products by the factor's square
  factor = rope_attention_factor(c.rope_scaling)
  q[..., latent_rank:] = rope(queries[..., nope:], cos, sin) * (scale * np.float32(factor * factor))
  out = np.empty((rows, n_heads * q.shape[-1]), dtype=np.float32)
  attend(q, out)
  latents = out.reshape(rows, n_heads, -1)[..., :latent_rank].transpose(1, 0, 2)  # (heads, rows, latent)
  return heads_product(latents, layer.value_up).transpose(1, 0, 2).reshape(rows, n_heads * c.v_head_dim)

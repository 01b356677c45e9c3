"""Llama in numpy, float32: one step runs many requests at once.

Token-parallel work (projections, MLP, norms, head) runs on all rows of all requests together; attention
runs per request against that request's own KV cache ("selective batching")."""
import math
from typing import Dict, List, Sequence

import numpy as np

from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig, rope_inv_freq


class KVCache:
  """One request's keys and values for this shard's layers, grown as the request uses it."""

  def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int = 64):
    self.data = np.zeros((n_layers, 2, n_kv_heads, capacity, head_dim), dtype=np.float32)
    self.length = 0

  def reserve(self, length: int) -> None:
    capacity = self.data.shape[3]
    if length > capacity:
      grown = np.zeros(self.data.shape[:3] + (max(length, 2 * capacity), self.data.shape[4]), dtype=np.float32)
      grown[:, :, :, :self.length] = self.data[:, :, :, :self.length]
      self.data = grown

  @property
  def nbytes(self) -> int:
    return self.data.nbytes


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
  return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


class Llama:
  def __init__(self, config: LlamaConfig, shard: Shard, weights: Dict[str, np.ndarray]):
    self.config, self.shard = config, shard
    self.layers = []
    for i in range(shard.start_layer, shard.end_layer + 1):
      p = f"model.layers.{i}."
      w = lambda name: weights[p + name]
      self.layers.append({
        "attn_norm": w("input_layernorm.weight"), "mlp_norm": w("post_attention_layernorm.weight"),
        # Fused and pre-transposed so each projection is one (rows, in) @ (in, out) product.
        "qkv": np.ascontiguousarray(np.concatenate([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]).T),
        "o": np.ascontiguousarray(w("self_attn.o_proj.weight").T),
        "gate_up": np.ascontiguousarray(np.concatenate([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]).T),
        "down": np.ascontiguousarray(w("mlp.down_proj.weight").T),
      })
    self.embed = weights.get("model.embed_tokens.weight") if shard.is_first_layer() else None
    if shard.is_last_layer():
      self.norm = weights["model.norm.weight"]
      self.head = weights.get("lm_head.weight", weights.get("model.embed_tokens.weight"))
    self.inv_freq = rope_inv_freq(config)

  def new_cache(self) -> KVCache:
    return KVCache(len(self.layers), self.config.n_kv_heads, self.config.head_dim)

  def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

  def forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    """inputs[i]: token ids (L_i,) on the first shard, else hidden states (L_i, d).
    Returns per request: hidden states (L_i, d), or on the last shard the logits of its last position (1, vocab)."""
    c = self.config
    lengths = [len(x) for x in inputs]
    starts = [cache.length for cache in caches]
    if self.embed is not None:
      h = self.embed[np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in inputs])]
    else:
      h = np.concatenate([np.asarray(x, dtype=np.float32).reshape(-1, c.hidden_size) for x in inputs])
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    angles = positions[:, None].astype(np.float32) * self.inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    for cache, s, n in zip(caches, starts, lengths):
      cache.reserve(s + n)

    hd, n_heads, n_kv = c.head_dim, c.n_heads, c.n_kv_heads
    group, q_size, kv_size = n_heads // n_kv, n_heads * hd, n_kv * hd
    scale = 1.0 / math.sqrt(hd)
    offsets = np.cumsum([0] + lengths)
    for li, layer in enumerate(self.layers):
      qkv = rms_norm(h, layer["attn_norm"], c.rms_norm_eps) @ layer["qkv"]
      q = self._rope(qkv[:, :q_size].reshape(-1, n_heads, hd), cos, sin)
      k = self._rope(qkv[:, q_size:q_size + kv_size].reshape(-1, n_kv, hd), cos, sin)
      v = qkv[:, q_size + kv_size:].reshape(-1, n_kv, hd)
      attn = np.empty((h.shape[0], q_size), dtype=np.float32)
      for r, (cache, s, n) in enumerate(zip(caches, starts, lengths)):
        a, b = offsets[r], offsets[r + 1]
        kv = cache.data[li]
        kv[0, :, s:s + n] = k[a:b].transpose(1, 0, 2)
        kv[1, :, s:s + n] = v[a:b].transpose(1, 0, 2)
        keys, values = kv[0, :, :s + n], kv[1, :, :s + n]  # (n_kv, T, hd)
        qr = q[a:b].reshape(n, n_kv, group, hd).transpose(1, 2, 0, 3).reshape(n_kv, group * n, hd)
        scores = (qr @ keys.transpose(0, 2, 1)) * scale  # (n_kv, group*n, T)
        if n > 1:  # causal: query i (at position s+i) sees keys up to s+i
          mask = np.arange(s + n)[None, :] > (s + np.arange(n))[:, None]
          scores = scores.reshape(n_kv, group, n, s + n)
          scores[:, :, mask] = -np.inf
          scores = scores.reshape(n_kv, group * n, s + n)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        scores /= scores.sum(axis=-1, keepdims=True)
        out = (scores @ values).reshape(n_kv, group, n, hd).transpose(2, 0, 1, 3)
        attn[a:b] = out.reshape(n, q_size)
      h = h + attn @ layer["o"]
      gate_up = rms_norm(h, layer["mlp_norm"], c.rms_norm_eps) @ layer["gate_up"]
      gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
      h = h + ((gate / (1.0 + np.exp(-gate))) * up) @ layer["down"]
    for cache, s, n in zip(caches, starts, lengths):
      cache.length = s + n

    if not self.shard.is_last_layer():
      return [h[offsets[r]:offsets[r + 1]] for r in range(len(inputs))]
    last = h[offsets[1:] - 1]  # only each request's last position is ever sampled
    logits = rms_norm(last, self.norm, c.rms_norm_eps) @ self.head.T
    return [logits[r:r + 1] for r in range(len(inputs))]

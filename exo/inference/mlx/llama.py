"""Llama in MLX, float32: one step runs many requests at once.

Token-parallel work (projections, MLP, norms, head) runs on all rows of all requests together; attention runs per
request against that request's own KV cache ("selective batching"). MLX builds the step's graph lazily and
evaluates it once at the end; nothing is compiled, so no graph can carry one request's cache into another's step."""
import math
from typing import Dict, List, Sequence

import mlx.core as mx
import numpy as np

from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig, rope_inv_freq

MIN_CAPACITY = 64


class KVCache:
  """One request's keys and values: per layer one (n_kv_heads, capacity, head_dim) array each, capacity doubling as
  the request grows; only the first `length` positions are ever read."""

  def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int = MIN_CAPACITY):
    self.keys = [mx.zeros((n_kv_heads, capacity, head_dim), dtype=mx.float32) for _ in range(n_layers)]
    self.values = [mx.zeros((n_kv_heads, capacity, head_dim), dtype=mx.float32) for _ in range(n_layers)]
    self.capacity, self.length = capacity, 0

  def reserve(self, length: int) -> None:
    if length <= self.capacity:
      return
    grown = max(length, 2 * self.capacity)
    pad = [(0, 0), (0, grown - self.capacity), (0, 0)]
    self.keys = [mx.pad(k, pad) for k in self.keys]
    self.values = [mx.pad(v, pad) for v in self.values]
    self.capacity = grown

  def arrays(self) -> List[mx.array]:
    return self.keys + self.values

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in self.arrays())


def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Llama:
  def __init__(self, config: LlamaConfig, shard: Shard, weights: Dict[str, np.ndarray]):
    self.config, self.shard = config, shard
    self.layers = []
    for i in range(shard.start_layer, shard.end_layer + 1):
      w = lambda name: weights[f"model.layers.{i}.{name}"]
      self.layers.append({k: mx.array(a) for k, a in {
        "attn_norm": w("input_layernorm.weight"), "mlp_norm": w("post_attention_layernorm.weight"),
        # Fused and kept (out, in): x @ W.T is a transposed BLAS call, no copy.
        "qkv": np.concatenate([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]),
        "o": w("self_attn.o_proj.weight"),
        "gate_up": np.concatenate([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]),
        "down": w("mlp.down_proj.weight"),
      }.items()})
    embed = weights.get("model.embed_tokens.weight")
    self.embed = mx.array(embed) if shard.is_first_layer() else None
    if shard.is_last_layer():
      self.norm = mx.array(weights["model.norm.weight"])
      head = weights.get("lm_head.weight")
      # A tied head is the embedding itself: one array serves lookup and head.
      self.head = mx.array(head) if head is not None else self.embed if self.embed is not None else mx.array(embed)
    mx.eval([list(layer.values()) for layer in self.layers], [a for a in (self.embed, getattr(self, "norm", None), getattr(self, "head", None)) if a is not None])
    self.inv_freq = rope_inv_freq(config)

  def new_cache(self) -> KVCache:
    return KVCache(len(self.layers), self.config.n_kv_heads, self.config.head_dim)

  def forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    """inputs[i]: token ids (L_i,) on the first shard, else hidden states (L_i, d).
    Returns per request: hidden states (L_i, d), or on the last shard the logits of its last position (1, vocab)."""
    c = self.config
    lengths = [len(x) for x in inputs]
    starts = [cache.length for cache in caches]
    if self.shard.is_first_layer():
      h = self.embed[mx.array(np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in inputs]).astype(np.int32))]
    else:
      h = mx.array(np.concatenate([np.asarray(x, dtype=np.float32).reshape(-1, c.hidden_size) for x in inputs]))
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    angles = positions[:, None].astype(np.float32) * self.inv_freq[None, :]  # as the numpy engine computes them
    cos, sin = mx.array(np.cos(angles)[:, None, :]), mx.array(np.sin(angles)[:, None, :])
    masks = []
    for cache, s, n in zip(caches, starts, lengths):
      cache.reserve(s + n)
      # causal: query i (at position s+i) sees keys up to s+i; one new token sees everything, no mask needed
      masks.append(mx.array(np.arange(s + n)[None, :] <= (s + np.arange(n))[:, None]) if n > 1 else None)

    hd, n_heads, n_kv = c.head_dim, c.n_heads, c.n_kv_heads
    q_size, kv_size = n_heads * hd, n_kv * hd
    scale = 1.0 / math.sqrt(hd)
    offsets = np.cumsum([0] + lengths)
    for li, layer in enumerate(self.layers):
      qkv = mx.fast.rms_norm(h, layer["attn_norm"], c.rms_norm_eps) @ layer["qkv"].T
      q = rope(qkv[:, :q_size].reshape(-1, n_heads, hd), cos, sin)
      k = rope(qkv[:, q_size:q_size + kv_size].reshape(-1, n_kv, hd), cos, sin)
      v = qkv[:, q_size + kv_size:].reshape(-1, n_kv, hd)
      outs = []
      for r, (cache, s, n) in enumerate(zip(caches, starts, lengths)):
        a, b = int(offsets[r]), int(offsets[r + 1])
        cache.keys[li][:, s:s + n, :] = k[a:b].transpose(1, 0, 2)
        cache.values[li][:, s:s + n, :] = v[a:b].transpose(1, 0, 2)
        keys, values = cache.keys[li][None, :, :s + n], cache.values[li][None, :, :s + n]
        out = mx.fast.scaled_dot_product_attention(q[a:b].transpose(1, 0, 2)[None], keys, values, scale=scale, mask=masks[r])
        outs.append(out[0].transpose(1, 0, 2).reshape(n, q_size))
      h = h + (mx.concatenate(outs) if len(outs) > 1 else outs[0]) @ layer["o"].T
      gate_up = mx.fast.rms_norm(h, layer["mlp_norm"], c.rms_norm_eps) @ layer["gate_up"].T
      gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
      h = h + (gate * mx.sigmoid(gate) * up) @ layer["down"].T
    for cache, s, n in zip(caches, starts, lengths):
      cache.length = s + n

    if not self.shard.is_last_layer():
      mx.eval(h, [cache.arrays() for cache in caches])
      out = np.array(h)
      return [out[offsets[r]:offsets[r + 1]] for r in range(len(inputs))]
    last = h[mx.array((offsets[1:] - 1).astype(np.int32))]  # only each request's last position is ever sampled
    logits = mx.fast.rms_norm(last, self.norm, c.rms_norm_eps) @ self.head.T
    mx.eval(logits, [cache.arrays() for cache in caches])
    logits = np.array(logits)
    return [logits[r:r + 1] for r in range(len(inputs))]

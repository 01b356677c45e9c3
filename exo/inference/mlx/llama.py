"""Llama in MLX: one step runs many requests at once.

Token-parallel work (projections, MLP, norms, head) runs on all rows of all requests together; attention runs per
request against that request's own KV cache ("selective batching"). MLX builds the step's graph lazily and
evaluates it once at the end; nothing is compiled, so no graph can carry one request's cache into another's step.
Weights run as matrix.py keeps them (quantized checkpoints stay quantized)."""
import math
from typing import Dict, List, Sequence

import mlx.core as mx
import numpy as np

from exo.inference.llama_layout import StepRows, layer_weights, rope_inv_freq, shard_ends, step_input
from exo.inference.mlx.cache import KVCache
from exo.inference.mlx.matrix import Matrix, compute_dtype, matrix
from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig


def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Llama:
  def __init__(self, config: LlamaConfig, shard: Shard, weights: Dict[str, np.ndarray]):
    self.config, self.shard = config, shard
    self.dtype = dtype = compute_dtype(config)
    vector = lambda a: mx.array(a).astype(dtype)
    self.layers = []
    for layer in layer_weights(weights, shard):
      matrices = {"qkv": matrix(layer.qkv, dtype), "o": Matrix(layer.o, dtype), "gate_up": matrix(layer.gate_up, dtype),
                  "down": Matrix(layer.down, dtype)}
      norms = {"attn_norm": vector(layer.attn_norm), "mlp_norm": vector(layer.mlp_norm)}
      mx.eval([m.arrays() for m in matrices.values()], list(norms.values()))  # now, before the next layer is fused
      self.layers.append({**matrices, **norms})
    ends = shard_ends(weights, shard)
    self.embed = None if ends.embed is None else Matrix(ends.embed, dtype)
    self.head = self.embed if ends.shared else None if ends.head is None else Matrix(ends.head, dtype)
    self.norm = None if ends.norm is None else vector(ends.norm)
    mx.eval([m.arrays() for m in (self.embed, self.head) if m is not None], [self.norm] if self.norm is not None else [])
    self.inv_freq = rope_inv_freq(config)

  def new_cache(self) -> KVCache:
    return KVCache(len(self.layers), self.config.n_kv_heads, self.config.head_dim, self.dtype)

  def forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    """inputs[i]: token ids (L_i,) on the first shard, else hidden states (L_i, d).
    Returns per request: hidden states (L_i, d), or on the last shard the logits of its last position (1, vocab)."""
    c = self.config
    step = StepRows([len(x) for x in inputs], [cache.length for cache in caches])
    x = step_input(inputs, self.shard.is_first_layer(), c.hidden_size)
    h = self.embed.rows(mx.array(x.astype(np.int32))) if self.shard.is_first_layer() else mx.array(x).astype(self.dtype)
    cos, sin = (mx.array(a).astype(self.dtype) for a in step.angles(self.inv_freq))
    masks = []
    for cache, s, n in zip(caches, step.starts, step.lengths):
      cache.reserve(s + n)
      # causal: query i (at position s+i) sees keys up to s+i; one new token sees everything, no mask needed
      masks.append(mx.array(np.arange(s + n)[None, :] <= (s + np.arange(n))[:, None]) if n > 1 else None)

    hd, n_heads, n_kv = c.head_dim, c.n_heads, c.n_kv_heads
    q_size, kv_size = n_heads * hd, n_kv * hd
    scale = 1.0 / math.sqrt(hd)
    for li, layer in enumerate(self.layers):
      qkv = layer["qkv"](mx.fast.rms_norm(h, layer["attn_norm"], c.rms_norm_eps))
      q = rope(qkv[:, :q_size].reshape(-1, n_heads, hd), cos, sin)
      k = rope(qkv[:, q_size:q_size + kv_size].reshape(-1, n_kv, hd), cos, sin)
      v = qkv[:, q_size + kv_size:].reshape(-1, n_kv, hd)
      outs = []
      for r, (cache, s, n) in enumerate(zip(caches, step.starts, step.lengths)):
        a = int(step.offsets[r])
        cache.keys[li][:, s:s + n, :] = k[a:a + n].transpose(1, 0, 2)
        cache.values[li][:, s:s + n, :] = v[a:a + n].transpose(1, 0, 2)
        keys, values = cache.keys[li][None, :, :s + n], cache.values[li][None, :, :s + n]
        out = mx.fast.scaled_dot_product_attention(q[a:a + n].transpose(1, 0, 2)[None], keys, values, scale=scale, mask=masks[r])
        outs.append(out[0].transpose(1, 0, 2).reshape(n, q_size))
      h = h + layer["o"](mx.concatenate(outs) if len(outs) > 1 else outs[0])
      gate_up = layer["gate_up"](mx.fast.rms_norm(h, layer["mlp_norm"], c.rms_norm_eps))
      gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
      h = h + layer["down"](gate * mx.sigmoid(gate) * up)
    for cache, s, n in zip(caches, step.starts, step.lengths):
      cache.length = s + n

    if not self.shard.is_last_layer():
      h = h.astype(mx.float32)  # hidden states travel as float32
      mx.eval(h, [cache.arrays() for cache in caches])
      return step.split(np.array(h))
    last = h[mx.array(step.last_rows.astype(np.int32))]  # only each request's last position is ever sampled
    logits = self.head(mx.fast.rms_norm(last, self.norm, c.rms_norm_eps)).astype(mx.float32)
    mx.eval(logits, [cache.arrays() for cache in caches])
    logits = np.array(logits)
    return [logits[r:r + 1] for r in range(len(inputs))]

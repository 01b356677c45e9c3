"""The dense decoder (Llama and the families exo/inference/models describes as it) in MLX: one step runs many
requests at once.

Token-parallel work (projections, MLP, norms, head) runs on all rows of all requests together; attention runs per
request against that request's own KV cache ("selective batching"). MLX builds the step's graph lazily and
evaluates it once at the end; nothing is compiled, so no graph can carry one request's cache into another's step.
Weights run as matrix.py keeps them (quantized checkpoints stay quantized)."""
import math
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from exo.inference.llama_layout import StepRows, layer_weights, rope_tables, shard_ends, step_input
from exo.inference.mlx.cache import KVCache
from exo.inference.mlx.matrix import Matrix, compute_dtype, matrix
from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig


def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


VECTORS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "qkv_bias", "o_bias", "q_norm", "k_norm")  # None where a family has none


def gelu_tanh(x: mx.array) -> mx.array:
  return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def soft_cap(x: mx.array, cap: Optional[float]) -> mx.array:
  return x if cap is None else mx.tanh(x / cap) * cap


def residual(x: mx.array, scale: float) -> mx.array:
  return x if scale == 1.0 else x * scale


def rms_norm(x: mx.array, weight: Optional[mx.array], eps: float) -> mx.array:
  return x if weight is None else mx.fast.rms_norm(x, weight, eps)


class Llama:
  def __init__(self, config: LlamaConfig, shard: Shard, weights: Dict[str, np.ndarray]):
    self.config, self.shard = config, shard
    if config.activation not in ("silu", "gelu_tanh"):
      raise ValueError(f"activation {config.activation!r} is not implemented by the MLX engine")
    self.dtype = dtype = compute_dtype(config)
    vector = lambda a: mx.array(a).astype(dtype)
    self.layers = []
    for layer in layer_weights(weights, shard, config):
      matrices = {"qkv": matrix(layer.qkv, dtype), "o": Matrix(layer.o, dtype)}
      if layer.experts is None:
        matrices.update(gate_up=matrix(layer.gate_up, dtype), down=Matrix(layer.down, dtype))
      vectors = {name: None if getattr(layer, name) is None else vector(getattr(layer, name)) for name in VECTORS}
      # a mixture of experts: the router (hidden, experts), and every expert's matrices stacked as (in, out) for gather_mm
      vectors["router"] = None if layer.router is None else vector(layer.router.T)
      vectors["experts_gate_up"] = None if layer.experts is None else vector(np.stack([gate_up.T for gate_up, _ in layer.experts]))
      vectors["experts_down"] = None if layer.experts is None else vector(np.stack([down.T for _, down in layer.experts]))
      mx.eval([m.arrays() for m in matrices.values()], [a for a in vectors.values() if a is not None])  # now, before the next layer is fused
      self.layers.append({**matrices, **vectors})
    ends = shard_ends(weights, shard, config)
    self.embed = None if ends.embed is None else Matrix(ends.embed, dtype)
    self.head = self.embed if ends.shared else None if ends.head is None else Matrix(ends.head, dtype)
    self.norm = None if ends.norm is None else vector(ends.norm)
    mx.eval([m.arrays() for m in (self.embed, self.head) if m is not None], [self.norm] if self.norm is not None else [])
    self.layer_ids = list(range(shard.start_layer, shard.end_layer + 1))
    self.rope_tables, self.rope_of_layer = rope_tables(config, self.layer_ids)

  def new_cache(self) -> KVCache:
    return KVCache(len(self.layers), self.config.n_kv_heads, self.config.head_dim, self.dtype)

  def forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    """inputs[i]: token ids (L_i,) on the first shard, else hidden states (L_i, d).
    Returns per request: hidden states (L_i, d), or on the last shard the logits of its last position (1, vocab)."""
    c = self.config
    step = StepRows([len(x) for x in inputs], [cache.length for cache in caches])
    x = step_input(inputs, self.shard.is_first_layer(), c.hidden_size)
    h = self.embed.rows(mx.array(x.astype(np.int32))) if self.shard.is_first_layer() else mx.array(x).astype(self.dtype)
    if self.shard.is_first_layer() and c.embedding_scale != 1.0:
      h = h * mx.array(c.embedding_scale, dtype=self.dtype)
    angles = [[mx.array(a).astype(self.dtype) for a in step.angles(table)] for table in self.rope_tables]
    windows = sorted({c.sliding_window if c.slides(layer) else None for layer in self.layer_ids}, key=lambda w: w or 0)
    masks = {window: [] for window in windows}  # per request, for each window the shard's layers use (None: causal only)
    for cache, s, n in zip(caches, step.starts, step.lengths):
      cache.reserve(s + n)
      keys, queries = np.arange(s + n)[None, :], (s + np.arange(n))[:, None]
      for window in windows:
        # causal: query i (at position s+i) sees keys up to s+i; a sliding layer's, no more than `window` back.
        # One new token with everything in sight needs no mask.
        visible = (keys <= queries) & (keys > queries - window) if window is not None else keys <= queries
        masks[window].append(None if visible.all() else mx.array(visible))

    hd, n_heads, n_kv = c.head_dim, c.n_heads, c.n_kv_heads
    q_size, kv_size = n_heads * hd, n_kv * hd
    scale = c.attention_scale if c.attention_scale is not None else 1.0 / math.sqrt(hd)
    for li, layer in enumerate(self.layers):
      cos, sin = angles[self.rope_of_layer[li]]
      window = c.sliding_window if c.slides(self.layer_ids[li]) else None
      qkv = layer["qkv"](rms_norm(h, layer["attn_norm"], c.rms_norm_eps))
      if layer["qkv_bias"] is not None:
        qkv = qkv + layer["qkv_bias"]
      q, k, v = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
      if c.qk_norm == "projection":
        q, k = mx.fast.rms_norm(q, layer["q_norm"], c.rms_norm_eps), mx.fast.rms_norm(k, layer["k_norm"], c.rms_norm_eps)
      q, k, v = q.reshape(-1, n_heads, hd), k.reshape(-1, n_kv, hd), v.reshape(-1, n_kv, hd)
      if c.qk_norm == "head":
        q, k = mx.fast.rms_norm(q, layer["q_norm"], c.rms_norm_eps), mx.fast.rms_norm(k, layer["k_norm"], c.rms_norm_eps)
      q, k = rope(q, cos, sin), rope(k, cos, sin)
      outs = []
      for r, (cache, s, n) in enumerate(zip(caches, step.starts, step.lengths)):
        a = int(step.offsets[r])
        cache.keys[li][:, s:s + n, :] = k[a:a + n].transpose(1, 0, 2)
        cache.values[li][:, s:s + n, :] = v[a:a + n].transpose(1, 0, 2)
        keys, values = cache.keys[li][None, :, :s + n], cache.values[li][None, :, :s + n]
        queries = q[a:a + n].transpose(1, 0, 2)[None]
        if c.attn_softcap is None:
          out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=masks[window][r])
        else:
          out = softcapped_attention(queries, keys, values, scale, c.attn_softcap, masks[window][r])
        outs.append(out[0].transpose(1, 0, 2).reshape(n, q_size))
      attn = layer["o"](mx.concatenate(outs) if len(outs) > 1 else outs[0])
      if layer["o_bias"] is not None:
        attn = attn + layer["o_bias"]
      h = h + residual(rms_norm(attn, layer["post_attn_norm"], c.rms_norm_eps), c.residual_scale)
      x = rms_norm(h, layer["mlp_norm"], c.rms_norm_eps)
      if layer["router"] is not None:
        mlp = self._experts(x, layer)
      else:
        gate_up = layer["gate_up"](x)
        mlp = layer["down"](self._act(gate_up[:, :c.intermediate_size]) * gate_up[:, c.intermediate_size:])
      h = h + residual(rms_norm(mlp, layer["post_mlp_norm"], c.rms_norm_eps), c.residual_scale)
    for cache, s, n in zip(caches, step.starts, step.lengths):
      cache.length = s + n

    if not self.shard.is_last_layer():
      h = h.astype(mx.float32)  # hidden states travel as float32
      mx.eval(h, [cache.arrays() for cache in caches])
      return step.split(np.array(h))
    last = h[mx.array(step.last_rows.astype(np.int32))]  # only each request's last position is ever sampled
    logits = self.head(mx.fast.rms_norm(last, self.norm, c.rms_norm_eps)).astype(mx.float32) * c.logits_scale
    logits = soft_cap(logits, c.final_softcap)
    mx.eval(logits, [cache.arrays() for cache in caches])
    logits = np.array(logits)
    return [logits[r:r + 1] for r in range(len(inputs))]

  def _act(self, gate: mx.array) -> mx.array:
    return gelu_tanh(gate) if self.config.activation == "gelu_tanh" else gate * mx.sigmoid(gate)

  def _experts(self, x: mx.array, layer: dict) -> mx.array:
    """A mixture-of-experts MLP: each row through its k experts only (gather_mm picks each row's expert matrices),
    their outputs summed by the router's weights (llama_layout.route's rule)."""
    c, k, inter = self.config, self.config.experts_per_token, self.config.expert_intermediate_size
    probs = mx.softmax((x @ layer["router"]).astype(mx.float32), axis=-1)
    chosen = mx.argpartition(-probs, kth=k - 1, axis=-1)[:, :k]
    weights = mx.take_along_axis(probs, chosen, axis=-1)
    if c.normalize_expert_weights:
      weights = weights / weights.sum(axis=-1, keepdims=True)
    gate_up = mx.gather_mm(mx.expand_dims(x, (-2, -3)), layer["experts_gate_up"], rhs_indices=chosen)  # (rows, k, 1, 2 inter)
    out = mx.gather_mm(self._act(gate_up[..., :inter]) * gate_up[..., inter:], layer["experts_down"], rhs_indices=chosen)  # (rows, k, 1, hidden)
    return (out.squeeze(-2) * weights[..., None].astype(out.dtype)).sum(axis=1)


def softcapped_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, cap: float, mask: Optional[mx.array]) -> mx.array:
  """Attention whose scores are soft-capped (Gemma 2), which MLX's fused kernel does not do: (1, heads, n, head_dim)
  queries over (1, kv heads, positions, head_dim) keys and values."""
  n_heads, n_kv = queries.shape[1], keys.shape[1]
  if n_heads != n_kv:
    keys, values = mx.repeat(keys, n_heads // n_kv, axis=1), mx.repeat(values, n_heads // n_kv, axis=1)
  scores = soft_cap((queries * scale) @ keys.transpose(0, 1, 3, 2), cap)
  if mask is not None:
    scores = mx.where(mask, scores, mx.array(-mx.inf, dtype=scores.dtype))
  return mx.softmax(scores.astype(mx.float32), axis=-1).astype(values.dtype) @ values

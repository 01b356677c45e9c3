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
from exo.inference.mlx.matrix import Experts, Matrix, compute_dtype, matrix
from exo.inference.models.config import rope_attention_factor
from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig


def rope(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


VECTORS = ("attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm", "qkv_bias", "o_bias", "q_norm", "k_norm", "sinks", "router_bias",
           "score_correction")  # None where a family has none


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
      matrices = {"o": Matrix(layer.o, dtype)}
      if layer.latent is None:
        matrices["qkv"] = matrix(layer.qkv, dtype)
      else:
        matrices.update(latent_matrices(layer.latent, dtype))
      if layer.experts is None:
        matrices.update(gate_up=matrix(layer.gate_up, dtype), down=Matrix(layer.down, dtype))
      vectors = {name: None if getattr(layer, name) is None else vector(getattr(layer, name)) for name in VECTORS}
      # a mixture of experts: the router (hidden, experts), and every expert's matrices stacked for gather_(q)mm
      stacked = lambda pairs, i: None if pairs is None else vector(np.stack([pair[i] for pair in pairs]))
      vectors.update(router=None if layer.router is None else vector(layer.router.T), experts_gate_up_bias=stacked(layer.expert_biases, 0),
                     experts_down_bias=stacked(layer.expert_biases, 1))
      if layer.experts is not None:
        matrices.update(experts_gate_up=Experts([pair[0] for pair in layer.experts], dtype), experts_down=Experts([pair[1] for pair in layer.experts], dtype))
      if layer.shared_expert is not None:
        matrices.update(shared_gate_up=Matrix(layer.shared_expert[0], dtype), shared_down=Matrix(layer.shared_expert[1], dtype))
      if layer.latent is not None:
        vectors.update({name: None if getattr(layer.latent, name) is None else vector(getattr(layer.latent, name)) for name in ("q_a_norm", "kv_a_norm")})
      mx.eval([m.arrays() for m in matrices.values() if m is not None], [a for a in vectors.values() if a is not None])  # now, before the next layer is fused
      self.layers.append({"latent": layer.latent is not None, "shared_gate_up": None, **matrices, **vectors})
    ends = shard_ends(weights, shard, config)
    self.embed = None if ends.embed is None else Matrix(ends.embed, dtype)
    self.head = self.embed if ends.shared else None if ends.head is None else Matrix(ends.head, dtype)
    self.norm = None if ends.norm is None else vector(ends.norm)
    mx.eval([m.arrays() for m in (self.embed, self.head) if m is not None], [self.norm] if self.norm is not None else [])
    self.layer_ids = list(range(shard.start_layer, shard.end_layer + 1))
    self.rope_tables, self.rope_of_layer = rope_tables(config, self.layer_ids)

  def new_cache(self) -> KVCache:
    c = self.config
    # a sliding layer's arrays keep only its window (cache.py)
    sliding = dict(window=c.sliding_window, sliding=[li for li, layer in enumerate(self.layer_ids) if c.slides(layer)])
    if c.latent_attention:  # the latent and the RoPE key, one head read as keys and values (latent_attention's docstring)
      return KVCache(len(self.layers), 1, c.kv_values_per_position, self.dtype, planes=1, **sliding)
    return KVCache(len(self.layers), c.n_kv_heads, c.head_dim, self.dtype, **sliding)

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
      queries = (s + np.arange(n))[:, None]
      for window in windows:
        # causal: query i (at position s+i) sees keys up to s+i; a sliding layer's, no more than `window` back (its
        # arrays hold the positions from cache.start on). One new token with everything in sight needs no mask.
        keys = np.arange(cache.start if window is not None else 0, s + n)[None, :]
        visible = (keys <= queries) & (keys > queries - window) if window is not None else keys <= queries
        masks[window].append(None if visible.all() else mx.array(visible))

    hd, n_heads, n_kv = c.head_dim, c.n_heads, c.n_kv_heads
    q_size, kv_size = n_heads * hd, n_kv * hd
    scale = c.attention_scale if c.attention_scale is not None else 1.0 / math.sqrt(hd)
    for li, layer in enumerate(self.layers):
      cos, sin = angles[self.rope_of_layer[li]]
      window = c.sliding_window if c.slides(self.layer_ids[li]) else None
      if layer["latent"]:
        attn = layer["o"](self._latent_attention(rms_norm(h, layer["attn_norm"], c.rms_norm_eps), layer, li, caches, step, cos, sin, masks[window]))
        h = h + residual(rms_norm(attn, layer["post_attn_norm"], c.rms_norm_eps), c.residual_scale)
        h = self._mlp(h, layer)
        continue
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
        a, o = int(step.offsets[r]), cache.origin(li)
        cache.keys[li][:, s - o:s + n - o, :] = k[a:a + n].transpose(1, 0, 2)
        cache.values[li][:, s - o:s + n - o, :] = v[a:a + n].transpose(1, 0, 2)
        keys, values = cache.keys[li][None, :, :s + n - o], cache.values[li][None, :, :s + n - o]
        queries = q[a:a + n].transpose(1, 0, 2)[None]
        if c.attn_softcap is None:
          out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=masks[window][r], sinks=layer["sinks"])
        else:
          out = softcapped_attention(queries, keys, values, scale, c.attn_softcap, masks[window][r])
        outs.append(out[0].transpose(1, 0, 2).reshape(n, q_size))
      attn = layer["o"](mx.concatenate(outs) if len(outs) > 1 else outs[0])
      if layer["o_bias"] is not None:
        attn = attn + layer["o_bias"]
      h = h + residual(rms_norm(attn, layer["post_attn_norm"], c.rms_norm_eps), c.residual_scale)
      h = self._mlp(h, layer)
    for cache, s, n in zip(caches, step.starts, step.lengths):
      cache.advance(s + n)

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

  def _mlp(self, h: mx.array, layer: dict) -> mx.array:
    """The residual stream after the layer's MLP (dense, or a mixture of experts)."""
    c = self.config
    x = rms_norm(h, layer["mlp_norm"], c.rms_norm_eps)
    if layer["router"] is not None:
      mlp = self._experts(x, layer)
    else:
      gate_up = layer["gate_up"](x)
      mlp = layer["down"](self._act(gate_up[:, :c.intermediate_size]) * gate_up[:, c.intermediate_size:])
    return h + residual(rms_norm(mlp, layer["post_mlp_norm"], c.rms_norm_eps), c.residual_scale)

  def _act(self, gate: mx.array) -> mx.array:
    return gelu_tanh(gate) if self.config.activation == "gelu_tanh" else gate * mx.sigmoid(gate)

  def _gated(self, gate_up: mx.array) -> mx.array:
    """An expert's activation from its gate and up outputs side by side (..., 2 * inter)."""
    c = self.config
    gate, up = mx.split(gate_up, 2, axis=-1)
    if c.swiglu_limit is not None:  # gpt-oss's clamped SwiGLU
      gate, up = mx.minimum(gate, c.swiglu_limit), mx.clip(up, -c.swiglu_limit, c.swiglu_limit)
      return (up + 1) * gate * mx.sigmoid(c.swiglu_alpha * gate)
    return self._act(gate) * up

  def _experts(self, x: mx.array, layer: dict) -> mx.array:
    """A mixture-of-experts MLP: each row through its k experts only (gather_mm picks each row's expert matrices),
    their outputs summed by the router's weights (llama_layout.route's rule), and a shared expert where there is one."""
    logits = (x @ layer["router"]).astype(mx.float32)
    if layer["router_bias"] is not None:
      logits = logits + layer["router_bias"].astype(mx.float32)
    chosen, weights = route(logits, self.config, layer["score_correction"])
    gate_up = layer["experts_gate_up"](mx.expand_dims(x, (-2, -3)), chosen)  # (rows, k, 1, 2 inter)
    if layer["experts_gate_up_bias"] is not None:
      gate_up = gate_up + mx.expand_dims(layer["experts_gate_up_bias"][chosen], -2)
    out = layer["experts_down"](self._gated(gate_up), chosen)  # (rows, k, 1, hidden)
    if layer["experts_down_bias"] is not None:
      out = out + mx.expand_dims(layer["experts_down_bias"][chosen], -2)
    out = (out.squeeze(-2) * weights[..., None].astype(out.dtype)).sum(axis=1)
    if layer["shared_gate_up"] is not None:
      out = out + layer["shared_down"](self._gated(layer["shared_gate_up"](x)))
    return out

  def _latent_attention(self, x: mx.array, layer: dict, li: int, caches: Sequence[KVCache], step: StepRows, cos: mx.array, sin: mx.array,
                        masks: list) -> mx.array:
    """Multi-head latent attention in the latent space, as exo/inference/numpy/latent_attention.py computes it:
    every head attends over the cached (latent, RoPE key) rows, one KV head whose keys are their own values. Before
    the output projection: (rows, heads * v)."""
    c = self.config
    rows, n_heads, nope, rank = x.shape[0], c.n_heads, c.qk_nope_head_dim, c.kv_lora_rank
    q_in = x if layer["q_a"] is None else mx.fast.rms_norm(layer["q_a"](x), layer["q_a_norm"], c.rms_norm_eps)
    queries = layer["q_b"](q_in).reshape(rows, n_heads, nope + c.qk_rope_head_dim)
    compressed = layer["kv_a"](x)
    entry = mx.concatenate([mx.fast.rms_norm(compressed[:, :rank], layer["kv_a_norm"], c.rms_norm_eps),
                            rope(compressed[:, None, rank:], cos, sin)[:, 0]], axis=-1)
    factor = rope_attention_factor(c.rope_scaling)  # yarn's cos and sin factor, on the RoPE part alone
    q = mx.concatenate([layer["embed_q"](queries[..., :nope].transpose(1, 0, 2)).transpose(1, 0, 2),
                        rope(queries[..., nope:], cos, sin) * (factor * factor)], axis=-1)
    outs = []
    for r, (cache, s, n) in enumerate(zip(caches, step.starts, step.lengths)):
      a, o = int(step.offsets[r]), cache.origin(li)
      cache.keys[li][:, s - o:s + n - o, :] = entry[a:a + n][None]
      keys = cache.keys[li][None, :, :s + n - o]
      out = mx.fast.scaled_dot_product_attention(q[a:a + n].transpose(1, 0, 2)[None], keys, keys[..., :rank], scale=c.attention_scale, mask=masks[r])
      outs.append(out[0])  # (heads, n, latent)
    latents = mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    return layer["unembed_out"](latents).transpose(1, 0, 2).reshape(rows, n_heads * c.v_head_dim)


def latent_matrices(weights, dtype) -> dict:
  """Latent attention's projections; kv_b's halves as each head's own matrix (Matrix over a stack)."""
  return {"q_a": None if weights.q_a is None else Matrix(weights.q_a, dtype), "q_b": Matrix(weights.q_b, dtype), "kv_a": Matrix(weights.kv_a, dtype),
          "embed_q": Matrix(weights.embed_q, dtype), "unembed_out": Matrix(weights.unembed_out, dtype)}


def route(logits: mx.array, c: LlamaConfig, score_correction: Optional[mx.array]):
  """Each row's k experts and their weights, by llama_layout.route's rules (float32 logits)."""
  k = c.experts_per_token
  top_k = lambda values: mx.argpartition(-values, kth=k - 1, axis=-1)[:, :k]
  if c.router == "topk_softmax":
    chosen = top_k(logits)
    return chosen, mx.softmax(mx.take_along_axis(logits, chosen, axis=-1), axis=-1)
  if c.router == "sigmoid_grouped":
    scores = mx.sigmoid(logits)
    choosing = scores if score_correction is None else scores + score_correction.astype(mx.float32)
    groups = choosing.reshape(choosing.shape[0], c.n_expert_groups, -1)
    group_scores = mx.sort(groups, axis=-1)[..., -2:].sum(axis=-1)
    n_hidden = c.n_expert_groups - c.expert_groups_searched
    if n_hidden > 0:
      hidden = mx.argpartition(group_scores, kth=n_hidden - 1, axis=-1)[:, :n_hidden]  # the groups not searched
      groups = mx.put_along_axis(groups, mx.expand_dims(hidden, -1), mx.array(-mx.inf, dtype=groups.dtype), axis=1)
    chosen = top_k(groups.reshape(choosing.shape))
    weights = mx.take_along_axis(scores, chosen, axis=-1)
    if c.normalize_expert_weights:
      weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return chosen, weights * c.routed_scaling_factor
  probs = mx.softmax(logits, axis=-1)
  chosen = top_k(probs)
  weights = mx.take_along_axis(probs, chosen, axis=-1)
  if c.normalize_expert_weights:
    weights = weights / weights.sum(axis=-1, keepdims=True)
  return chosen, weights


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

"""Llama in MLX: one step runs many requests at once.

Token-parallel work (projections, MLP, norms, head) runs on all rows of all requests together; attention runs per
request against that request's own KV cache ("selective batching"). MLX builds the step's graph lazily and
evaluates it once at the end; nothing is compiled, so no graph can carry one request's cache into another's step.

Quantized checkpoints stay quantized in memory and run through mx.quantized_matmul, as mlx-lm runs them. On a GPU
the model computes in the checkpoint's own precision (bf16/fp16); on the CPU in float32, where MLX's kernels are
fastest. MLX's CPU quantized matmul has no BLAS behind it and its cost grows with every row (about 3x a float32
matmul for one row, 30-40x at 16): for steps of more than QMM_MAX_ROWS rows (prefill, big batches) the CPU
dequantises each matrix just for that product and uses BLAS, which keeps memory at the quantized size. (SmolLM2 4-bit,
one step: quantized matmul 0.6x the time of dequantise+BLAS at 4 rows, 1.4x at 8.)"""
import math
from typing import Dict, List, Sequence

import mlx.core as mx
import numpy as np

from exo.inference.quantized import QuantizedWeight, stack_rows
from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig, rope_inv_freq

MIN_CAPACITY = 64
QMM_MAX_ROWS = 6
ON_GPU = mx.default_device().type == mx.DeviceType.gpu


def compute_dtype(config: LlamaConfig) -> mx.Dtype:
  if not ON_GPU:
    return mx.float32
  return {"bfloat16": mx.bfloat16, "float16": mx.float16}.get(config.dtype, mx.float32)


class Matrix:
  """An (out, in) weight for x @ W.T and row lookups: float, or MLX-quantized (packed codes, scales, biases)."""

  def __init__(self, w, dtype: mx.Dtype):
    self.dtype = dtype
    if isinstance(w, QuantizedWeight):
      self.weight = mx.array(w.packed)
      # affine scales and biases take the compute dtype; the mx modes' scales are uint8 exponents, kept as stored
      self.scales = mx.array(w.scales).astype(dtype) if w.mode == "affine" else mx.array(w.scales)
      self.biases = None if w.biases is None else mx.array(w.biases).astype(dtype)
      self.format = {"group_size": w.group_size, "bits": w.bits, **({"mode": w.mode} if w.mode != "affine" else {})}
    else:
      self.weight, self.scales, self.biases = mx.array(w).astype(dtype), None, None

  def arrays(self) -> List[mx.array]:
    return [a for a in (self.weight, self.scales, self.biases) if a is not None]

  def _dense(self, weight, scales, biases) -> mx.array:
    return mx.dequantize(weight, scales, biases, **self.format).astype(self.dtype)

  def __call__(self, x: mx.array) -> mx.array:
    if self.scales is None:
      return x @ self.weight.T  # (out, in) kept as stored: a transposed BLAS call, no copy
    if not ON_GPU and x.shape[0] > QMM_MAX_ROWS:
      return x @ self._dense(self.weight, self.scales, self.biases).T
    return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True, **self.format)

  def rows(self, ids: mx.array) -> mx.array:
    if self.scales is None:
      return self.weight[ids]
    return self._dense(self.weight[ids], self.scales[ids], None if self.biases is None else self.biases[ids])


class Stacked:
  """Matrices quantized differently (mlx-lm's per-layer overrides), side by side: their outputs concatenated."""

  def __init__(self, matrices: List[Matrix]):
    self.matrices = matrices

  def arrays(self) -> List[mx.array]:
    return [a for m in self.matrices for a in m.arrays()]

  def __call__(self, x: mx.array) -> mx.array:
    return mx.concatenate([m(x) for m in self.matrices], axis=-1)


def fused(parts: Sequence, dtype: mx.Dtype):
  """Parts stacked along their outputs (q/k/v, gate/up), as one matrix where they are stored alike: one product."""
  if not any(isinstance(p, QuantizedWeight) for p in parts):
    return Matrix(np.concatenate(parts), dtype)
  if all(isinstance(p, QuantizedWeight) and p.same_format(parts[0]) for p in parts):
    return Matrix(stack_rows(parts), dtype)
  return Stacked([Matrix(p, dtype) for p in parts])


class KVCache:
  """One request's keys and values: per layer one (n_kv_heads, capacity, head_dim) array each, capacity doubling as
  the request grows; only the first `length` positions are ever read."""

  def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32, capacity: int = MIN_CAPACITY):
    self.keys = [mx.zeros((n_kv_heads, capacity, head_dim), dtype=dtype) for _ in range(n_layers)]
    self.values = [mx.zeros((n_kv_heads, capacity, head_dim), dtype=dtype) for _ in range(n_layers)]
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
    self.dtype = dtype = compute_dtype(config)
    vector = lambda a: mx.array(a).astype(dtype)
    self.layers = []
    for i in range(shard.start_layer, shard.end_layer + 1):
      w = lambda name: weights[f"model.layers.{i}.{name}"]
      self.layers.append({
        "attn_norm": vector(w("input_layernorm.weight")), "mlp_norm": vector(w("post_attention_layernorm.weight")),
        "qkv": fused([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")], dtype),
        "o": Matrix(w("self_attn.o_proj.weight"), dtype),
        "gate_up": fused([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")], dtype),
        "down": Matrix(w("mlp.down_proj.weight"), dtype),
      })
    embed = weights.get("model.embed_tokens.weight")
    self.embed = Matrix(embed, dtype) if shard.is_first_layer() else None
    if shard.is_last_layer():
      self.norm = vector(weights["model.norm.weight"])
      head = weights.get("lm_head.weight")
      # A tied head is the embedding itself: one matrix serves lookup and head.
      self.head = Matrix(head, dtype) if head is not None else self.embed if self.embed is not None else Matrix(embed, dtype)
    arrays = lambda v: v.arrays() if isinstance(v, (Matrix, Stacked)) else v
    mx.eval([[arrays(v) for v in layer.values()] for layer in self.layers],
            [arrays(v) for v in (self.embed, getattr(self, "norm", None), getattr(self, "head", None)) if v is not None])
    self.inv_freq = rope_inv_freq(config)

  def new_cache(self) -> KVCache:
    return KVCache(len(self.layers), self.config.n_kv_heads, self.config.head_dim, self.dtype)

  def copy_prefix(self, source: KVCache, cache: KVCache, positions: int) -> None:
    """Start `cache` with the first `positions` positions of `source` (evaluated now: the source goes on growing)."""
    cache.reserve(positions)
    for mine, theirs in zip(cache.arrays(), source.arrays()):
      mine[:, :positions] = theirs[:, :positions]
    mx.eval(cache.arrays())
    cache.length = positions

  def forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    """inputs[i]: token ids (L_i,) on the first shard, else hidden states (L_i, d).
    Returns per request: hidden states (L_i, d), or on the last shard the logits of its last position (1, vocab)."""
    c = self.config
    lengths = [len(x) for x in inputs]
    starts = [cache.length for cache in caches]
    if self.shard.is_first_layer():
      h = self.embed.rows(mx.array(np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in inputs]).astype(np.int32)))
    else:
      h = mx.array(np.concatenate([np.asarray(x, dtype=np.float32).reshape(-1, c.hidden_size) for x in inputs])).astype(self.dtype)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    angles = positions[:, None].astype(np.float32) * self.inv_freq[None, :]  # as the numpy engine computes them
    cos, sin = (mx.array(f(angles)[:, None, :]).astype(self.dtype) for f in (np.cos, np.sin))
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
      qkv = layer["qkv"](mx.fast.rms_norm(h, layer["attn_norm"], c.rms_norm_eps))
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
      h = h + layer["o"](mx.concatenate(outs) if len(outs) > 1 else outs[0])
      gate_up = layer["gate_up"](mx.fast.rms_norm(h, layer["mlp_norm"], c.rms_norm_eps))
      gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
      h = h + layer["down"](gate * mx.sigmoid(gate) * up)
    for cache, s, n in zip(caches, starts, lengths):
      cache.length = s + n

    if not self.shard.is_last_layer():
      h = h.astype(mx.float32)  # hidden states travel as float32
      mx.eval(h, [cache.arrays() for cache in caches])
      out = np.array(h)
      return [out[offsets[r]:offsets[r + 1]] for r in range(len(inputs))]
    last = h[mx.array((offsets[1:] - 1).astype(np.int32))]  # only each request's last position is ever sampled
    logits = self.head(mx.fast.rms_norm(last, self.norm, c.rms_norm_eps)).astype(mx.float32)
    mx.eval(logits, [cache.arrays() for cache in caches])
    logits = np.array(logits)
    return [logits[r:r + 1] for r in range(len(inputs))]

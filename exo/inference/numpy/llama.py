"""Llama in numpy, float32: one step runs many requests at once.

All rows of all requests go through each weight product together, the product's columns shared among the cores
(kernels.py); attention reads each request's slot of the KV pool (cache.py, attention.py).

Every step of a layer that follows a product runs inside that product's column slices, on whichever core computed
them: RoPE and the cache write after q/k/v, the residual add after the output and down projections, SiLU-and-gate
after gate/up (whose columns are interleaved in 32-column pairs so that each slice holds both halves). Only the
two RMS norms of a layer, over whole rows, run between the slices."""
import math
from typing import Dict, List, Sequence

import numpy as np

from exo.inference.llama_layout import in_caller_order, layer_weights, rope_inv_freq, shard_ends, step_input
from exo.inference.numpy.attention import Step
from exo.inference.numpy.cache import KVCache, KVPool
from exo.inference.numpy.kernels import product, split_columns, split_over_cores, weight_matrix, weight_rows
from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig

PAIR = 32  # gate/up columns interleaved in pairs of PAIR gate columns then PAIR up columns


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
  """x: (rows, d). A layer's two norms run on one core between the cores' slices, so they are kept lean: the sum of
  squares in one pass and one temporary (64 rows: 9.5 ms a step against 13.9 with x * x and a mean)."""
  scale = 1.0 / np.sqrt(np.einsum("ij,ij->i", x, x) * (1.0 / x.shape[-1]) + eps)
  out = np.multiply(x, weight)
  out *= scale[:, None]
  return out


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def interleaved_pairs(outputs: int) -> np.ndarray:
  """The order of fused gate/up's 2 * inter outputs as the engine computes them: PAIR gate outputs, then the PAIR up
  outputs of the same units, and so on."""
  return np.arange(outputs).reshape(2, -1, PAIR).transpose(1, 0, 2).reshape(-1)


class Llama:
  def __init__(self, config: LlamaConfig, shard: Shard, weights: Dict[str, np.ndarray]):
    self.config, self.shard = config, shard
    c = config
    if c.intermediate_size % PAIR:
      raise ValueError(f"intermediate size {c.intermediate_size} is not a multiple of {PAIR}")
    # A product's output columns are what the cores share (kernels.weight_matrix: float (in, out), or kept quantized).
    self.layers = [{"attn_norm": layer.attn_norm, "mlp_norm": layer.mlp_norm, "qkv": weight_matrix(layer.qkv),
                    "o": weight_matrix(layer.o), "gate_up": weight_matrix(layer.gate_up, interleaved_pairs(2 * c.intermediate_size)),
                    "down": weight_matrix(layer.down)}
                   for layer in layer_weights(weights, shard)]
    ends = shard_ends(weights, shard)
    self.norm = ends.norm
    self.head = None if ends.head is None else weight_matrix(ends.head)
    self.embed = None if ends.shared or ends.embed is None else weight_matrix(ends.embed)  # shared: tokens are looked up in the head
    self.inv_freq = rope_inv_freq(config)
    self.pool = KVPool(len(self.layers), c.n_kv_heads, c.head_dim, c.max_position_embeddings)

  def new_cache(self) -> KVCache:
    return KVCache(self.pool)

  def _embed(self, ids: np.ndarray) -> np.ndarray:
    return weight_rows(self.embed if self.embed is not None else self.head, ids)

  def forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    """inputs[i]: token ids (L_i,) on the first shard, else hidden states (L_i, d).
    Returns per request: hidden states (L_i, d), or on the last shard the logits of its last position (1, vocab)."""
    c = self.config
    for x, cache in zip(inputs, caches):
      if cache.length + len(x) > cache.capacity:
        raise ValueError(f"a request of {cache.length + len(x)} positions exceeds the context of {cache.capacity}")
    # Requests in slot order, so that neighbours in the pool are neighbours in the step.
    order = sorted(range(len(inputs)), key=lambda r: caches[r].slot)
    inputs, caches = [inputs[r] for r in order], [caches[r] for r in order]
    lengths = [len(x) for x in inputs]
    h = step_input(inputs, self.shard.is_first_layer(), c.hidden_size)
    if self.shard.is_first_layer():
      h = self._embed(h)
    step = Step(self.pool, caches, lengths)
    h = self._layers(h, step)
    for cache, n in zip(caches, lengths):
      cache.length += n

    if self.head is None:
      outputs = step.layout.split(h)
    else:
      last = rms_norm(h[step.layout.last_rows], self.norm, c.rms_norm_eps)  # only each request's last position is sampled
      logits = np.empty((len(inputs), c.vocab_size), dtype=np.float32)

      def head(a: int, b: int) -> None:
        product(last, self.head, a, b, out=logits[:, a:b])
      split_columns(head, c.vocab_size, 256, step.rows)
      outputs = [logits[i:i + 1] for i in range(len(inputs))]
    return in_caller_order(order, outputs)

  def _layers(self, h: np.ndarray, step: Step) -> np.ndarray:
    c = self.config
    hd, n_heads, n_kv = c.head_dim, c.n_heads, c.n_kv_heads
    rows = step.rows
    cos, sin = step.layout.angles(self.inv_freq)
    scale = np.float32(1.0 / math.sqrt(hd))
    q = np.empty((rows, n_heads, hd), dtype=np.float32)  # scaled, turned queries
    attn = np.empty((rows, n_heads * hd), dtype=np.float32)
    act = np.empty((rows, c.intermediate_size), dtype=np.float32)
    x = None

    for li, layer in enumerate(self.layers):
      def qkv(a: int, b: int) -> None:  # whole heads: queries, then keys, then values
        out = product(x, layer["qkv"], a, b).reshape(rows, -1, hd)
        ha, hb = a // hd, b // hd
        for head0, head1, kind in ((0, n_heads, "q"), (n_heads, n_heads + n_kv, "k"), (n_heads + n_kv, n_heads + 2 * n_kv, "v")):
          lo, hi = max(ha, head0), min(hb, head1)
          if lo >= hi:
            continue
          part = out[:, lo - ha:hi - ha]
          if kind == "q":
            q[:, lo:hi] = rope(part, cos, sin) * scale
            continue
          values = rope(part, cos, sin) if kind == "k" else part
          for slab, row_range, slots, positions in step.writes:
            slab[slots, li, int(kind == "v"), lo - head0:hi - head0, positions] = values[row_range]

      def attend(lo: int, hi: int) -> None:
        for g in range(lo, hi):
          for job in step.job_groups[g]:
            job.attend(li, q, attn, n_kv)

      def o_proj(a: int, b: int) -> None:
        h[:, a:b] += product(attn, layer["o"], a, b)

      def gate_up(a: int, b: int) -> None:
        pairs = product(x, layer["gate_up"], a, b).reshape(rows, -1, 2, PAIR)
        gate, up = pairs[:, :, 0], pairs[:, :, 1]
        out = act[:, a // 2:b // 2].reshape(rows, -1, PAIR)
        np.negative(gate, out=out)  # silu(gate) * up, in place: these are the layer's largest elementwise arrays
        np.exp(out, out=out)
        out += 1.0
        np.divide(gate, out, out=out)
        out *= up

      def down(a: int, b: int) -> None:
        h[:, a:b] += product(act, layer["down"], a, b)

      x = rms_norm(h, layer["attn_norm"], c.rms_norm_eps)
      split_columns(qkv, (n_heads + 2 * n_kv) * hd, hd, rows)
      if len(step.job_groups) > 1:
        split_over_cores(attend, len(step.job_groups))
      else:
        attend(0, len(step.job_groups))
      split_columns(o_proj, c.hidden_size, 32, rows)
      x = rms_norm(h, layer["mlp_norm"], c.rms_norm_eps)
      split_columns(gate_up, 2 * c.intermediate_size, 2 * PAIR, rows)
      split_columns(down, c.hidden_size, 32, rows)
    return h

"""The dense decoder (Llama and the families exo/inference/models describes as it) in numpy, float32 (its KV cache
float16, cache.py): one step runs many requests at once.

All rows of all requests go through each weight product together, the product's columns shared among the cores
(kernels.py); attention reads each request's slot of the KV pool (cache.py, attention.py).

Every step of a layer that follows a product runs inside that product's column slices, on whichever core computed
them: RoPE and the cache write after q/k/v, the residual add after the output and down projections, SiLU-and-gate
after gate/up (whose columns are interleaved in 32-column pairs so that each slice holds both halves). Only the
two RMS norms of a layer, over whole rows, run between the slices.

A step of decode rows (up to fused_decode.MOST_ROWS) of a plain quantized model, with none of the other families'
features, runs every layer in one compiled call instead; where the shard's ends are quantized too, the whole step
from token ids to logits (fused_decode.py)."""
import math
from contextlib import nullcontext
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from exo.inference.llama_layout import in_caller_order, layer_weights, rope_tables, route, shard_ends, step_input
from exo.inference.numpy.attention import Step, finish_logits
from exo.inference.numpy.cache import KVCache, KVPool
from exo.inference.numpy.kernels import Workers, full_product, product, split_columns, split_over_cores, weight_matrix, weight_rows
from exo.inference.numpy.fused_decode import FusedDecode
from exo.inference.numpy.packed import DIRECT_ROWS, PackedMatrix, SharedDecode
from exo.inference.numpy.latent_attention import LatentAttention, latent_attention
from exo.inference.numpy.rotary import rope
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


def gelu_tanh(x: np.ndarray, out: np.ndarray) -> None:
  """GELU's tanh approximation (Gemma's GeGLU), into out."""
  np.multiply(x, x, out=out)
  out *= np.float32(0.044715)
  out += 1.0
  out *= x
  out *= np.float32(math.sqrt(2 / math.pi))
  np.tanh(out, out=out)
  out += 1.0
  out *= x
  out *= 0.5


def gelu_tanh_of(x: np.ndarray) -> np.ndarray:
  out = np.empty_like(x)
  gelu_tanh(x, out)
  return out


ACTIVATIONS = ("silu", "gelu_tanh")


def interleaved_pairs(outputs: int) -> np.ndarray:
  """The order of fused gate/up's 2 * inter outputs as the engine computes them: PAIR gate outputs, then the PAIR up
  outputs of the same units, and so on."""
  return np.arange(outputs).reshape(2, -1, PAIR).transpose(1, 0, 2).reshape(-1)


class Llama:
  def __init__(self, config: LlamaConfig, shard: Shard, weights: Dict[str, np.ndarray], kv_dtype=None):
    self.config, self.shard = config, shard
    c = config
    if c.intermediate_size % PAIR:
      raise ValueError(f"intermediate size {c.intermediate_size} is not a multiple of {PAIR}")
    if c.activation not in ACTIVATIONS:
      raise ValueError(f"activation {c.activation!r} is not implemented by the numpy engine")
    # A product's output columns are what the cores share (kernels.weight_matrix: float (in, out), or kept quantized).
    # The rest as the layout gives it (None where the family has no such part).
    in_out = lambda pair: None if pair is None else (weight_matrix(pair[0]), weight_matrix(pair[1]))  # an expert's, kept quantized where it is
    self.layers = [{**layer.__dict__, "qkv": None if layer.qkv is None else weight_matrix(layer.qkv), "o": weight_matrix(layer.o),
                    "gate_up": None if layer.gate_up is None else weight_matrix(layer.gate_up, interleaved_pairs(2 * c.intermediate_size)),
                    "down": None if layer.down is None else weight_matrix(layer.down),
                    "router": None if layer.router is None else np.ascontiguousarray(layer.router.T),
                    "experts": None if layer.experts is None else [in_out(pair) for pair in layer.experts],
                    "shared_expert": in_out(layer.shared_expert),
                    "latent": None if layer.latent is None else LatentAttention(layer.latent, config)}
                   for layer in layer_weights(weights, shard, config)]
    ends = shard_ends(weights, shard, config)
    self.norm = ends.norm
    self.head = None if ends.head is None else weight_matrix(ends.head)
    self.embed = None if ends.shared or ends.embed is None else weight_matrix(ends.embed)  # shared: tokens are looked up in the head
    self.layer_ids = list(range(shard.start_layer, shard.end_layer + 1))
    self.rope_tables, self.rope_of_layer = rope_tables(config, self.layer_ids)
    # a sliding layer's rows keep only its window (cache.py)
    sliding = dict(window=c.sliding_window, sliding=[li for li, layer in enumerate(self.layer_ids) if c.slides(layer)])
    if c.latent_attention:  # one plane, one head: the latent and the RoPE key, read as keys and as values (latent_attention.py)
      self.pool = KVPool(len(self.layers), 1, c.kv_values_per_position, c.max_position_embeddings, planes=1, dtype=kv_dtype, **sliding)
    else:
      self.pool = KVPool(len(self.layers), c.n_kv_heads, c.head_dim, c.max_position_embeddings, dtype=kv_dtype, **sliding)
    quantized = any(isinstance(layer["o"], PackedMatrix) for layer in self.layers) or isinstance(self.head, PackedMatrix)
    self.shared_decode = SharedDecode() if quantized else None  # whether a decode step shares its products among OpenMP's threads
    self.fused_decode = FusedDecode.build(self)  # a plain layer's decode steps in one compiled call (None: not this model's)

  def new_cache(self) -> KVCache:
    return KVCache(self.pool)

  def _embed(self, ids: np.ndarray) -> np.ndarray:
    return weight_rows(self.embed if self.embed is not None else self.head, ids)

  def forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    """inputs[i]: token ids (L_i,) on the first shard, else hidden states (L_i, d).
    Returns per request: hidden states (L_i, d), or on the last shard the logits of its last position (1, vocab)."""
    with self._decode_step(inputs):
      whole = None if self.fused_decode is None else self.fused_decode.step(inputs, caches)
      return whole if whole is not None else self._forward(inputs, caches)

  def _decode_step(self, inputs: Sequence[np.ndarray]):
    """Whether the step shares its products among OpenMP's threads (packed.SharedDecode), decided and timed: up to
    the direct products' rows, or as many as the fused pass takes where each input is one decode row."""
    if self.shared_decode is None:
      return nullcontext()
    decode = self.fused_decode is not None and all(len(x) == 1 for x in inputs)
    return self.shared_decode.step(sum(len(x) for x in inputs), self.fused_decode.MOST_ROWS if decode else DIRECT_ROWS)

  def _forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    c = self.config
    h, step, order = self._run(inputs, caches)
    if self.head is None:
      outputs = step.layout.split(h)
    else:
      last = rms_norm(h[step.layout.last_rows], self.norm, c.rms_norm_eps)  # only each request's last position is sampled
      logits = np.empty((len(inputs), c.vocab_size), dtype=np.float32)

      def head(a: int, b: int) -> None:
        product(last, self.head, a, b, out=logits[:, a:b])
      split_columns(head, c.vocab_size, 256, step.rows)
      finish_logits(logits, c)
      outputs = [logits[i:i + 1] for i in range(len(inputs))]
    return in_caller_order(order, outputs)

  def final_states(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache], workers: Optional[Workers] = None) -> List[np.ndarray]:
    """Per request, every input position's state after the final norm (L_i, d): what an embedding model built on this
    decoder pools (transformers' base model's last_hidden_state). The whole model only; the products are shared
    among `workers` (the engine's by default)."""
    if not (self.shard.is_first_layer() and self.shard.is_last_layer()):
      raise ValueError("final states need the whole model on one shard")
    with self._decode_step(inputs):
      h, step, order = self._run(inputs, caches, workers)
    return in_caller_order(order, step.layout.split(rms_norm(h, self.norm, self.config.rms_norm_eps)))

  def _run(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache], workers: Optional[Workers] = None) -> Tuple[np.ndarray, Step, List[int]]:
    """The shard's layers over every request's rows, their keys and values written to their caches: (the last
    layer's states of the step's rows, the step, the order the requests were run in)."""
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
      if c.embedding_scale != 1.0:
        h *= np.float32(c.embedding_scale)
    step = Step(self.pool, caches, lengths)
    h = self._layers(h, step, workers)
    for cache, n in zip(caches, lengths):
      cache.advance(n)
    return h, step, order

  def _layers(self, h: np.ndarray, step: Step, workers: Optional[Workers] = None) -> np.ndarray:
    if self.fused_decode is not None and workers is None and self.fused_decode.takes(step):
      return self.fused_decode.run(h, step)
    c = self.config
    hd, n_heads, n_kv = c.head_dim, c.n_heads, c.n_kv_heads
    rows = step.rows
    angles = [step.layout.angles(table) for table in self.rope_tables]
    scale = np.float32(c.attention_scale if c.attention_scale is not None else 1.0 / math.sqrt(hd))
    residual_scale = None if c.residual_scale == 1.0 else np.float32(c.residual_scale)
    q = np.empty((rows, n_heads, hd), dtype=np.float32)  # scaled, turned queries
    attn = np.empty((rows, n_heads * hd), dtype=np.float32)
    act = np.empty((rows, c.intermediate_size), dtype=np.float32)
    qkv_width = (n_heads + 2 * n_kv) * hd
    # a whole projection to normalise (OLMo 2), or a branch's output to normalise before the residual add (Gemma)
    projected = np.empty((rows, qkv_width), dtype=np.float32) if c.qk_norm == "projection" else None
    branch = np.empty_like(h) if any(role.startswith("post_") for role, _ in c.layer_norms) else None
    gelu = c.activation == "gelu_tanh"
    x = None

    for li, layer in enumerate(self.layers):
      cos, sin = angles[self.rope_of_layer[li]]
      window = c.sliding_window if c.slides(self.layer_ids[li]) else None

      def rope_and_write(out: np.ndarray, a: int, b: int) -> None:
        """Columns a..b of the q/k/v projection (whole heads, biases added): queries turned and scaled into q,
        keys turned and values into the cache."""
        out = out.reshape(rows, -1, hd)
        ha, hb = a // hd, b // hd
        for head0, head1, kind in ((0, n_heads, "q"), (n_heads, n_heads + n_kv, "k"), (n_heads + n_kv, n_heads + 2 * n_kv, "v")):
          lo, hi = max(ha, head0), min(hb, head1)
          if lo >= hi:
            continue
          part = out[:, lo - ha:hi - ha]
          if kind != "v" and c.qk_norm == "head":
            part = rms_norm(part.reshape(-1, hd), layer[f"{kind}_norm"], c.rms_norm_eps).reshape(part.shape)
          if kind == "q":
            rope(part, cos, sin, scale, out=q[:, lo:hi])
            continue
          values = rope(part, cos, sin) if kind == "k" else part
          for slab, row_range, slots, positions in step.writes:
            slab[slots, li, int(kind == "v"), lo - head0:hi - head0, positions] = values[row_range]

      def qkv(a: int, b: int) -> None:  # whole heads: queries, then keys, then values
        out = product(x, layer["qkv"], a, b)
        if layer["qkv_bias"] is not None:
          out += layer["qkv_bias"][a:b]
        if projected is None:
          rope_and_write(out, a, b)
        else:
          projected[:, a:b] = out

      def attend_all(q: np.ndarray, attn: np.ndarray, n_kv: int) -> None:
        """Every attention job of the step, queries q into attn (latent attention: its own, one KV head), the cores
        sharing the job groups."""
        def attend(lo: int, hi: int) -> None:
          for g in range(lo, hi):
            for job in step.job_groups[g]:
              job.attend(li, q, attn, n_kv, window=window, softcap=c.attn_softcap, sinks=layer["sinks"])
        if len(step.job_groups) > 1:
          split_over_cores(attend, len(step.job_groups), workers)
        else:
          attend(0, len(step.job_groups))

      def o_proj(a: int, b: int) -> None:
        out = product(attended, layer["o"], a, b)
        if layer["o_bias"] is not None:
          out += layer["o_bias"][a:b]
        add_branch(out, a, b, layer["post_attn_norm"])

      def gate_up(a: int, b: int) -> None:
        pairs = product(x, layer["gate_up"], a, b).reshape(rows, -1, 2, PAIR)
        gate, up = pairs[:, :, 0], pairs[:, :, 1]
        out = act[:, a // 2:b // 2].reshape(rows, -1, PAIR)
        if gelu:
          gelu_tanh(gate, out)
        else:  # silu(gate), in place: these are the layer's largest elementwise arrays
          np.negative(gate, out=out)
          np.exp(out, out=out)
          out += 1.0
          np.divide(gate, out, out=out)
        out *= up

      def down(a: int, b: int) -> None:
        add_branch(product(act, layer["down"], a, b), a, b, layer["post_mlp_norm"])

      def add_branch(out: np.ndarray, a: int, b: int, post_norm) -> None:
        """A branch's columns a..b into the residual stream, or kept whole for its post-norm (finish_branch)."""
        if post_norm is not None:
          branch[:, a:b] = out
          return
        if residual_scale is not None:
          out *= residual_scale
        h[:, a:b] += out

      def finish_branch(post_norm) -> None:
        if post_norm is not None:
          out = rms_norm(branch, post_norm, c.rms_norm_eps)
          if residual_scale is not None:
            out *= residual_scale
          h[:] += out

      x = h if layer["attn_norm"] is None else rms_norm(h, layer["attn_norm"], c.rms_norm_eps)
      if layer["latent"] is not None:
        attended = latent_attention(x, layer["latent"], li, step, c, cos, sin, window, rms_norm, rope, lambda q, out: attend_all(q, out, 1))
      else:
        attended = attn
        split_columns(qkv, qkv_width, hd, rows, workers)
        if projected is not None:  # the norms span heads: after the whole product
          q_width, kv_width = n_heads * hd, n_kv * hd
          projected[:, :q_width] = rms_norm(projected[:, :q_width], layer["q_norm"], c.rms_norm_eps)
          projected[:, q_width:q_width + kv_width] = rms_norm(projected[:, q_width:q_width + kv_width], layer["k_norm"], c.rms_norm_eps)
          rope_and_write(projected, 0, qkv_width)
        attend_all(q, attn, n_kv)
      split_columns(o_proj, c.hidden_size, 32, rows, workers)
      finish_branch(layer["post_attn_norm"])
      x = h if layer["mlp_norm"] is None else rms_norm(h, layer["mlp_norm"], c.rms_norm_eps)
      if layer["experts"] is not None:
        add_branch(self._experts(x, layer), 0, c.hidden_size, layer["post_mlp_norm"])
      else:
        split_columns(gate_up, 2 * c.intermediate_size, 2 * PAIR, rows, workers)
        split_columns(down, c.hidden_size, 32, rows, workers)
      finish_branch(layer["post_mlp_norm"])
    return h

  def _experts(self, x: np.ndarray, layer: dict) -> np.ndarray:
    """A mixture-of-experts MLP: each expert computes only the rows routed to it (one core; the experts' products
    are small and many), from its matrices as kept (float, or quantized: only its own codes are read), and a shared
    expert, where the model has one, every row."""
    c = self.config
    logits = x @ layer["router"]
    if layer["router_bias"] is not None:
      logits += layer["router_bias"]
    chosen, weights = route(logits, c, layer["score_correction"])
    out = np.zeros_like(x)
    for e in np.unique(chosen):
      rows, slot = np.nonzero(chosen == e)  # a row picks an expert at most once
      gate_up, down = layer["experts"][e]
      biases = None if layer["expert_biases"] is None else layer["expert_biases"][e]
      projected = full_product(x[rows], gate_up)
      if biases is not None:
        projected += biases[0]
      expert_out = full_product(gated(projected, c), down)
      if biases is not None:
        expert_out += biases[1]
      out[rows] += expert_out * weights[rows, slot][:, None]
    if layer["shared_expert"] is not None:
      gate_up, down = layer["shared_expert"]
      out += full_product(gated(full_product(x, gate_up), c), down)
    return out


def gated(projected: np.ndarray, c: LlamaConfig) -> np.ndarray:
  """An expert's activation from its gate and up outputs side by side (rows, 2 * inter)."""
  gate, up = np.split(projected, 2, axis=-1)
  if c.swiglu_limit is not None:  # gpt-oss's clamped SwiGLU
    gate, up = np.minimum(gate, np.float32(c.swiglu_limit)), np.clip(up, -np.float32(c.swiglu_limit), np.float32(c.swiglu_limit))
    return (up + 1.0) * gate / (1.0 + np.exp(-np.float32(c.swiglu_alpha) * gate))
  act = gelu_tanh_of(gate) if c.activation == "gelu_tanh" else gate / (1.0 + np.exp(-gate))
  return act * up

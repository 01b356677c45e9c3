"""The dense decoder (Llama and the families exo/inference/models describes as it) in tinygrad: one step runs many
requests at once. Float32 on CPU devices; half precision on GPUs (their
fast path, and half the memory), with norms and softmax in float32 as tinygrad's own Llama does. EXO_TINYGRAD_DTYPE
(float16 or float32) overrides the choice. The half-precision path has not run on a GPU in this project's tests.

Token-parallel work (projections, MLP, norms, head) runs on all rows of all requests together; attention runs per
request against that request's own KV cache ("selective batching").

tinygrad pays heavily for scheduling un-jitted graphs, so each decoder layer runs through a TinyJit. A jit is keyed
by the step's shape signature (total rows, and per request its padded rows and cache capacity, all bucketed) and is
shared by every layer of the shard: weights, caches, masks and start positions are all jit *inputs*, so replaying
it for another layer or another request reads that layer's weights and that request's cache, never ones captured
earlier. A new signature costs one eager layer and one capture (plus code generation for new kernel shapes); steady
decoding replays. Attention reads the whole (bucketed) cache under a mask, so only the cache write needs a
symbolic position.

A mixture-of-experts layer (Mixtral, Qwen3-MoE) runs as two jits. The first is attention and the router's logits;
the host then picks each row's experts from those logits with the rule every engine shares (llama_layout.route). The
second runs a fixed number of expert slots, each a SwiGLU MLP over every row of the step weighted by a (rows, slots)
matrix that is zero where a row did not pick that slot's expert: exact, and shape-static, since which experts run
is an input (each expert's weights are a jit input) and not a shape. The slots are the experts some row of the step
picked, their count rounded up to a power of two (no more than the model has) and filled with unpicked experts at
weight zero; so a decode step reads the few experts it uses, not all of them."""
import math
from collections import OrderedDict
from typing import Dict, List, Sequence, Tuple

import numpy as np
from tinygrad import Device, Tensor, TinyJit, Variable

from exo import settings
from exo.inference.llama_layout import StepRows, in_caller_order, layer_weights, route, rope_tables, shard_ends, step_input
from exo.inference.models.config import check_engine
from exo.inference.shard import Shard
from exo.inference.tinygrad.cache import KVCache, bucket
from exo.inference.weights import LlamaConfig

MAX_JITS = 32  # shape signatures kept; each holds its own intermediate buffers
CPU_DEVICES = ("CPU", "CLANG", "LLVM", "PYTHON")


def float_dtype() -> type:
  choice = settings.env("EXO_TINYGRAD_DTYPE") or ("float32" if Device.DEFAULT in CPU_DEVICES else "float16")
  if choice not in ("float16", "float32"):
    raise ValueError(f"EXO_TINYGRAD_DTYPE={choice!r}: use float16 or float32")
  return np.dtype(choice).type


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
  x32 = x.float()  # squares of half-precision activations overflow
  return (x32 * (x32 * x32).mean(-1, keepdim=True).add(eps).rsqrt()).cast(x.dtype) * weight


def flat_tensor(parts, dtype) -> Tensor:
  """Arrays as one flat device tensor, which a jit takes as one input and views apart."""
  return Tensor(np.concatenate([np.asarray(a).reshape(-1) for a in parts]).astype(dtype)).realize()


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
  half = x.shape[-1] // 2
  x1, x2 = x[..., :half], x[..., half:]
  return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)


class Llama:
  def __init__(self, config: LlamaConfig, shard: Shard, weights: Dict[str, np.ndarray]):
    self.config, self.shard = config, shard
    check_engine(config, "TinygradDynamicShardInferenceEngine")
    if config.activation not in ("silu", "gelu_tanh"):
      raise ValueError(f"activation {config.activation!r} is not implemented by the tinygrad engine")
    self.dtype = dtype = float_dtype()
    # Each layer's weights live in one flat tensor (the jit reads views of it): a jit's per-call cost grows with its
    # number of inputs. Matrices are kept (out, in), so every output reduces over contiguous memory: x @ W.T.
    self.layers: List[Tensor] = []
    # each part's name and shape, in the flat tensor's order: for dense layers and for mixture-of-experts layers
    self.weight_shapes: Dict[bool, List[Tuple[str, Tuple[int, ...]]]] = {}
    self.experts: List[List[Tensor]] = []  # a MoE layer's experts, each one flat tensor (gate/up, then down); [] in a dense layer
    self.expert_shapes: List[Tuple[str, Tuple[int, ...]]] = []
    for layer in layer_weights(weights, shard, config):
      parts = [(name, getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down", "attn_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm",
                                                         "qkv_bias", "o_bias", "q_norm", "k_norm", "router")
               if getattr(layer, name) is not None]  # the family's optional parts where it has them
      self.weight_shapes[layer.experts is not None] = [(name, a.shape) for name, a in parts]
      self.layers.append(flat_tensor([a for _, a in parts], dtype))
      self.experts.append([flat_tensor(pair, dtype) for pair in layer.experts or []])
      if layer.experts:
        self.expert_shapes = [("gate_up", layer.experts[0][0].shape), ("down", layer.experts[0][1].shape)]
    ends = shard_ends(weights, shard, config)
    # Token lookup is a gather: done on the host, so only the (rows, hidden) result travels to the device.
    self.embed = None if ends.embed is None else ends.embed.astype(dtype, copy=False)
    self.norm = None if ends.norm is None else Tensor(ends.norm.astype(dtype, copy=False)).realize()
    self.head = None if ends.head is None else Tensor(ends.head.astype(dtype, copy=False)).realize()
    self.layer_ids = list(range(shard.start_layer, shard.end_layer + 1))
    self.rope_tables, self.rope_of_layer = rope_tables(config, self.layer_ids)
    self.jits: "OrderedDict[tuple, List[TinyJit]]" = OrderedDict()

  def new_cache(self) -> KVCache:
    return KVCache(len(self.layers), self.config.n_kv_heads, self.config.head_dim, self.dtype)

  def _jit(self, key: tuple, fn, copies: int) -> List[TinyJit]:
    if key not in self.jits:
      self.jits[key] = [TinyJit(fn) for _ in range(copies)]
      while len(self.jits) > MAX_JITS:
        self.jits.popitem(last=False)
    self.jits.move_to_end(key)
    return self.jits[key]

  def _weights(self, flat: Tensor, shapes: List[Tuple[str, Tuple[int, ...]]]) -> Dict[str, Tensor]:
    out, offset = {}, 0
    for name, shape in shapes:
      out[name] = flat[offset:offset + math.prod(shape)].reshape(shape)
      offset += math.prod(shape)
    return out

  def _norm(self, x: Tensor, weight) -> Tensor:
    return x if weight is None else rms_norm(x, weight, self.config.rms_norm_eps)

  def _residual(self, x: Tensor) -> Tensor:
    return x if self.config.residual_scale == 1.0 else x * self.config.residual_scale

  def _gated(self, gate_up: Tensor, inter: int) -> Tensor:
    """The gated MLP's activation from its gate and up outputs side by side (rows, 2 * inter)."""
    gate = gate_up[:, :inter]
    return ((gate.gelu() if self.config.activation == "gelu_tanh" else gate.silu()) * gate_up[:, inter:]).contiguous()  # once, not per output

  def _layer(self, sig: tuple, h: Tensor, rope_cs: Tensor, masks: Tensor, flat_weights: Tensor, *args) -> Tensor:
    """One dense decoder layer. sig = (rows, then per request: (its padded rows, its cache capacity)); rope_cs =
    (cos, sin) per row; masks = every request's (rows, capacity) mask, flattened and concatenated; args = one KV cache
    per request, then one start position (a bound Variable) per request."""
    w = self._weights(flat_weights, self.weight_shapes[False])
    h = self._attention(sig, h, rope_cs, masks, w, *args)
    act = self._gated(self._norm(h, w.get("mlp_norm")) @ w["gate_up"].T, self.config.intermediate_size)
    return (h + self._residual(self._norm(act @ w["down"].T, w.get("post_mlp_norm")))).realize()

  def _moe_attention(self, sig: tuple, h: Tensor, rope_cs: Tensor, masks: Tensor, flat_weights: Tensor, *args) -> Tuple[Tensor, Tensor, Tensor]:
    """A mixture-of-experts layer's first part (arguments as _layer's): the states after attention, the experts'
    input (normalised), and the router's logits in float32 (the host routes from them)."""
    w = self._weights(flat_weights, self.weight_shapes[True])
    h = self._attention(sig, h, rope_cs, masks, w, *args)
    x = self._norm(h, w.get("mlp_norm"))
    return h.realize(), x.realize(), (x.float() @ w["router"].T.float()).realize()

  def _moe_experts(self, h: Tensor, x: Tensor, routing: Tensor, flat_weights: Tensor, *experts: Tensor) -> Tensor:
    """Its second part: every row through each slot's expert, weighted by routing (rows, slots), into the residual."""
    w = self._weights(flat_weights, self.weight_shapes[True])
    out = None
    for slot, flat in enumerate(experts):
      e = self._weights(flat, self.expert_shapes)
      expert_out = (self._gated(x @ e["gate_up"].T, self.config.expert_intermediate_size) @ e["down"].T) * routing[:, slot:slot + 1]
      out = expert_out if out is None else out + expert_out
    return (h + self._residual(self._norm(out, w.get("post_mlp_norm")))).realize()

  def _attention(self, sig: tuple, h: Tensor, rope_cs: Tensor, masks: Tensor, w: Dict[str, Tensor], *args) -> Tensor:
    """Attention's branch added into the residual stream (arguments as _layer's, the weights taken apart)."""
    c, n_req = self.config, len(sig) - 1
    scale = c.attention_scale if c.attention_scale is not None else 1.0 / math.sqrt(c.head_dim)
    norm, residual = self._norm, self._residual
    kv, starts = args[:n_req], args[n_req:]
    hd, n_heads, n_kv = c.head_dim, c.n_heads, c.n_kv_heads
    group, q_size, kv_size = n_heads // n_kv, n_heads * hd, n_kv * hd
    rows = h.shape[0]
    cos, sin = rope_cs[0], rope_cs[1]
    qkv = norm(h, w.get("attn_norm")) @ w["qkv"].T
    if "qkv_bias" in w:
      qkv = qkv + w["qkv_bias"]
    q, k = qkv[:, :q_size], qkv[:, q_size:q_size + kv_size]
    if c.qk_norm == "projection":
      q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
    q, k = q.reshape(rows, n_heads, hd), k.reshape(rows, n_kv, hd)
    if c.qk_norm == "head":
      q, k = norm(q, w["q_norm"]), norm(k, w["k_norm"])
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    v = qkv[:, q_size + kv_size:].reshape(rows, n_kv, hd)
    outs, offset, mask_offset = [], 0, 0
    for r, (n, capacity) in enumerate(sig[1:]):
      cache, s = kv[r], starts[r]
      cache.shrink((None, None, (s, s + n), None)).assign(k[offset:offset + n].stack(v[offset:offset + n]).permute(0, 2, 1, 3)).realize()
      keys, values = cache[0], cache[1]
      mask = masks[mask_offset:mask_offset + n * capacity].reshape(n, capacity)
      qr = q[offset:offset + n].reshape(n, n_kv, group, hd).permute(1, 2, 0, 3).reshape(n_kv, group * n, hd)
      scores = (qr @ keys.transpose(1, 2)).reshape(n_kv, group, n, capacity) * scale
      if c.attn_softcap is not None:
        scores = (scores / c.attn_softcap).tanh() * c.attn_softcap
      scores = scores + mask
      out = scores.float().softmax(-1).cast(values.dtype).reshape(n_kv, group * n, capacity) @ values  # (n_kv, group*n, hd)
      outs.append(out.reshape(n_kv, group, n, hd).permute(2, 0, 1, 3).reshape(n, q_size))
      offset, mask_offset = offset + n, mask_offset + n * capacity
    if offset < rows:  # rows padding the step to its bucket belong to no request
      outs.append(Tensor.zeros(rows - offset, q_size, dtype=h.dtype))
    attn = (outs[0].cat(*outs[1:]) if len(outs) > 1 else outs[0]) @ w["o"].T
    if "o_bias" in w:
      attn = attn + w["o_bias"]
    return h + residual(norm(attn, w.get("post_attn_norm")))

  def _moe_layer(self, sig: tuple, x: Tensor, layer_args: tuple, layer: Tensor, experts: List[Tensor], input_rows: np.ndarray) -> Tensor:
    """A mixture-of-experts layer: attention and the router on the device, routing on the host, then the experts some
    input row picked (padding rows pick none), in a bucketed number of slots."""
    h, x, logits = self._jit(("moe_attention", sig), lambda *a: self._moe_attention(sig, *a), 1)[0](x, *layer_args)
    chosen, weights = route(logits.numpy()[input_rows], self.config)
    used = np.unique(chosen)
    unused = np.setdiff1d(np.arange(len(experts)), used)
    slots = np.concatenate([used, unused[:min(bucket(len(used)), len(experts)) - len(used)]])
    routing = np.zeros((x.shape[0], len(experts)), dtype=self.dtype)
    routing[input_rows[:, None], chosen] = weights
    run = self._jit(("moe_experts", x.shape[0], len(slots)), self._moe_experts, 1)[0]
    return run(h, x, Tensor(np.ascontiguousarray(routing[:, slots])), layer, *[experts[e] for e in slots])

  def _head(self, select: Tensor, h: Tensor, norm: Tensor, head: Tensor) -> Tensor:
    c = self.config
    logits = rms_norm(select @ h, norm, c.rms_norm_eps) @ head.T
    if c.logits_scale != 1.0:
      logits = logits * c.logits_scale
    if c.final_softcap is not None:
      logits = (logits / c.final_softcap).tanh() * c.final_softcap
    return logits.realize()

  def forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    """inputs[i]: token ids (L_i,) on the first shard, else hidden states (L_i, d).
    Returns per request: hidden states (L_i, d), or on the last shard the logits of its last position (1, vocab)."""
    c = self.config
    lengths = [len(x) for x in inputs]
    padded = [bucket(n) for n in lengths]
    for cache, n in zip(caches, padded):
      cache.reserve(cache.length + n)
    # Requests in signature order, so the same mix of shapes reuses one jit whatever order they came in.
    order = sorted(range(len(inputs)), key=lambda r: (padded[r], caches[r].capacity))
    inputs, caches, sizes = [inputs[r] for r in order], [caches[r] for r in order], [padded[r] for r in order]
    step = StepRows([lengths[r] for r in order], [cache.length for cache in caches], sizes)
    rows = bucket(step.rows)  # the matmuls' shapes: few distinct ones, so few kernels to generate
    sig = (rows,) + tuple((p, cache.capacity) for p, cache in zip(sizes, caches))

    h = np.zeros((rows, c.hidden_size), dtype=self.dtype)  # padding rows stay zero
    given = step_input(inputs, self.shard.is_first_layer(), c.hidden_size)
    h[step.input_rows] = self.embed[given] * self.dtype(c.embedding_scale) if self.embed is not None else given
    # One set of masks per window the shard's layers use (None: causal only), one RoPE table per base; each layer
    # passes its own to the jit, which takes them as inputs like the weights.
    windows = [c.sliding_window if c.slides(layer) else None for layer in self.layer_ids]
    masks = {window: [] for window in windows}
    starts = []
    for slot, (cache, s, p) in enumerate(zip(caches, step.starts, sizes)):
      keys, queries = np.arange(cache.capacity)[None, :], (s + np.arange(p))[:, None]
      for window in masks:
        # causal: query i (at position s+i) sees keys up to s+i, in a sliding layer no more than `window` back;
        # later slots hold old padding or nothing yet
        hidden = (keys > queries) | (keys <= queries - window) if window is not None else keys > queries
        masks[window].append(np.where(hidden, -np.inf, 0.0).astype(self.dtype).reshape(-1))
      starts.append(Variable(f"start{slot}", 0, cache.capacity - p).bind(s))
    rope_cs = [Tensor(np.stack(step.angles(table, rows)).astype(self.dtype)) for table in self.rope_tables]
    masks = {window: Tensor(np.concatenate(parts)) for window, parts in masks.items()}

    # Two jits per signature, alternating by layer: a jit's output buffer is rewritten on its next replay, so it
    # is never fed back into the jit that owns it.
    jits = self._jit(("layer", sig), lambda *a: self._layer(sig, *a), 2)
    x = Tensor(h)
    for li, layer in enumerate(self.layers):
      layer_args = (rope_cs[self.rope_of_layer[li]], masks[windows[li]], layer, *[cache.kv[li] for cache in caches], *starts)
      if self.experts[li]:
        x = self._moe_layer(sig, x, layer_args, layer, self.experts[li], step.input_rows)
      else:
        x = jits[li % 2](x, *layer_args)
    for cache, n in zip(caches, step.lengths):
      cache.length += n

    if not self.shard.is_last_layer():
      out = x.numpy().astype(np.float32, copy=False)  # hidden states travel as float32
      return in_caller_order(order, [own.copy() for own in step.split(out)])
    select = np.zeros((len(caches), x.shape[0]), dtype=self.dtype)  # one-hot rows: each request's last real position
    select[np.arange(len(caches)), step.last_rows] = 1.0
    head = self._jit(("head",) + select.shape, self._head, 1)[0]
    logits = head(Tensor(select), x, self.norm, self.head).numpy().astype(np.float32, copy=False)
    return in_caller_order(order, [logits[i][None].copy() for i in range(len(caches))])

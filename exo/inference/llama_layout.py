"""What every Llama engine (numpy, tinygrad, MLX) lays out the same way, whatever array library computes the model.

Weights: which a shard holds, each layer's grouped for its fused products (q/k/v as one, gate/up as one), and the one
rule for the output head. A step: where each request's rows sit among the step's rows, their positions and RoPE
angles, and the row each request is sampled from. Everything here is numpy on the host; each engine's model class
(exo/inference/<backend>/llama.py) turns it into its own arrays and holds only the computation."""
import math
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from exo.inference.quantized import QuantizedWeight, stack_rows, take_rows
from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig

# A matrix as the loader gives it: float32 (out, in), or MLX-quantized for an engine that keeps it so.
Weight = Union[np.ndarray, QuantizedWeight]


def rope_inv_freq(config: LlamaConfig, theta: Optional[float] = None, scaling: Optional[dict] = None) -> np.ndarray:
  """Inverse RoPE frequencies (head_dim // 2,), scaled as the model asks (llama3's by wavelength, or linear); `theta`
  and `scaling` in place of the model's own (a sliding layer's, ModelConfig.rope_of)."""
  theta, scaling = (config.rope_theta, config.rope_scaling) if theta is None else (theta, scaling)
  dim = config.rope_dim
  inv_freq = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  scaling = scaling or {}
  if scaling.get("rope_type") == "yarn":
    return yarn_inv_freq(inv_freq, theta, dim, scaling).astype(np.float32)
  if scaling.get("rope_type", scaling.get("type")) == "llama3":
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    wavelen = 2 * np.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_context / low) & (wavelen >= old_context / high)
    inv_freq = np.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
  elif scaling.get("rope_type") == "linear":  # positions divided by the factor
    inv_freq = inv_freq / scaling["factor"]
  elif "freq_factors" in scaling:  # GGUF stores Llama-3 scaling as per-frequency divisors
    inv_freq = inv_freq / np.asarray(scaling["freq_factors"], dtype=np.float64)
  return inv_freq.astype(np.float32)


def yarn_inv_freq(inv_freq: np.ndarray, theta: float, dim: int, scaling: dict) -> np.ndarray:
  """Yarn's frequencies: those that turn fewer than beta_slow times over the original context divided by the
  factor (interpolated), those that turn more than beta_fast times kept (extrapolated), a linear ramp between.
  The cos and sin factor it also asks for is in the attention scale (models/config.py)."""
  factor, old_context = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
  beta_fast, beta_slow = scaling.get("beta_fast") or 32.0, scaling.get("beta_slow") or 1.0

  def dimension_turning(turns: float) -> float:  # the (fractional) dimension whose frequency turns `turns` times over the old context
    return dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(theta))
  low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
  if scaling.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  interpolated = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  return inv_freq / factor * interpolated + inv_freq * (1 - interpolated)


# --- weights ---

def fused(parts: Sequence[Weight]) -> Union[Weight, Tuple[Weight, ...]]:
  """Matrices stacked along their outputs, so that one product computes them all: one float array, or one
  QuantizedWeight where they are quantized alike. Parts quantized differently (mlx-lm's per-layer overrides) come
  back as they are, a tuple, for the engine to run side by side."""
  if not any(isinstance(p, QuantizedWeight) for p in parts):
    return np.concatenate(parts)
  if all(isinstance(p, QuantizedWeight) and p.same_format(parts[0]) for p in parts):
    return stack_rows(parts)
  return tuple(parts)


def fused_one(parts: Sequence[Weight]) -> Weight:
  """As fused, always one matrix: parts quantized differently are dequantised (an expert's gate and up, which a
  mixture of experts' products take as one)."""
  joined = fused(parts)
  return np.concatenate([p.dequantize() if isinstance(p, QuantizedWeight) else p for p in joined]) if isinstance(joined, tuple) else joined


def as_float(w: Weight) -> np.ndarray:
  return w.dequantize() if isinstance(w, QuantizedWeight) else w


@dataclass
class LayerWeights:
  """One decoder layer, in Hugging Face orientation (out, in). Norm weights are as the layer multiplies by them
  (a Gemma checkpoint's offset added); a norm the family does not have is None (ModelConfig.layer_norms)."""
  qkv: Union[Weight, Tuple[Weight, ...]]  # q, k and v projections fused: rows n_heads * head_dim, then n_kv_heads * head_dim twice
  o: Weight
  gate_up: Optional[Union[Weight, Tuple[Weight, ...]]]  # gate and up projections fused: intermediate_size rows each (None: experts)
  down: Optional[Weight]
  attn_norm: Optional[np.ndarray] = None  # before attention
  mlp_norm: Optional[np.ndarray] = None  # before the MLP
  post_attn_norm: Optional[np.ndarray] = None  # of attention's output, before the residual add
  post_mlp_norm: Optional[np.ndarray] = None  # of the MLP's output, before the residual add
  qkv_bias: Optional[np.ndarray] = None  # (q + 2 kv rows,) where the model has them (ModelConfig.qkv_bias)
  o_bias: Optional[np.ndarray] = None  # (hidden,)
  q_norm: Optional[np.ndarray] = None  # RMS norm weights before RoPE (ModelConfig.qk_norm): (head_dim,) over each
  k_norm: Optional[np.ndarray] = None  # head, or (n_heads * head_dim,) / (n_kv_heads * head_dim,) over the projection
  router: Optional[np.ndarray] = None  # (n_experts, hidden), in a mixture-of-experts layer (ModelConfig.is_moe)
  experts: Optional[List[Tuple[Weight, Weight]]] = None  # each expert's fused gate/up (2 * inter, hidden) and down, float or quantized
  router_bias: Optional[np.ndarray] = None  # (n_experts,) on the router's logits (gpt-oss)
  score_correction: Optional[np.ndarray] = None  # (n_experts,) added to the scores to choose experts by (DeepSeek)
  expert_biases: Optional[List[Tuple[np.ndarray, np.ndarray]]] = None  # each expert's gate/up (2 * inter,) and down (hidden,)
  shared_expert: Optional[Tuple[Weight, Weight]] = None  # gate/up and down of the MLP beside the experts (DeepSeek)
  sinks: Optional[np.ndarray] = None  # (n_heads,) learned logits (ModelConfig.attention_sinks)
  latent: Optional["LatentAttentionWeights"] = None  # multi-head latent attention's matrices, where qkv is None


@dataclass
class LatentAttentionWeights:
  """Multi-head latent attention (ModelConfig.latent_attention), (out, in) as stored, the RoPE dimensions of q_b and
  kv_a in rotate-half order (rope_half_order)."""
  q_a: Optional[Weight]  # (q_lora_rank, hidden), or None where queries are one projection (q_b: (heads * qk_head, hidden))
  q_a_norm: Optional[np.ndarray]
  q_b: Weight  # (heads * (nope + rope), q_lora_rank)
  kv_a: Weight  # (kv_lora_rank + rope, hidden): the latent, then the key's RoPE part shared by every head
  kv_a_norm: np.ndarray  # (kv_lora_rank,)
  # kv_b split by head, as mlx-lm stores it: each head's query nope part into the latent space (heads, latent, nope),
  # and its output out of it (heads, v, latent); float, or quantized stacks (mlx-lm's conversions)
  embed_q: Weight
  unembed_out: Weight


def rope_half_order(rows: int, rope: int) -> np.ndarray:
  """The order of a projection's rows that puts each block of `rope` RoPE rows, stored as interleaved pairs (DeepSeek's
  rope_interleave), in rotate-half order: pairs (x0, x1), (x2, x3)... become x0, x2, ..., x1, x3, ...; the rest stay.
  Queries and keys move alike, so their products are unchanged."""
  order = np.arange(rows).reshape(-1, rope)
  return np.concatenate([order[:, 0::2], order[:, 1::2]], axis=1).reshape(-1)


def latent_attention_weights(w, prefix: str, config: LlamaConfig) -> LatentAttentionWeights:
  c = config
  q_head, rope = c.qk_nope_head_dim + c.qk_rope_head_dim, c.qk_rope_head_dim
  # each query head's RoPE part is its last `rope` rows; the key's, kv_a's last rows
  q_order = np.concatenate([h * q_head + np.concatenate([np.arange(c.qk_nope_head_dim), c.qk_nope_head_dim + rope_half_order(rope, rope)])
                            for h in range(c.n_heads)])
  kv_order = np.concatenate([np.arange(c.kv_lora_rank), c.kv_lora_rank + rope_half_order(rope, rope)])
  if not c.rope_interleaved:
    q_order, kv_order = np.arange(len(q_order)), np.arange(len(kv_order))
  kv_b = w.get("self_attn.kv_b_proj.weight")
  if kv_b is not None:  # (heads * (nope + v), latent) as transformers stores it; a quantized one dequantised, as its key
    # part is used transposed (grouped along the latent, not along nope)
    kv_b = as_float(kv_b).reshape(c.n_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
    embed_q, unembed_out = np.ascontiguousarray(kv_b[:, :c.qk_nope_head_dim].transpose(0, 2, 1)), np.ascontiguousarray(kv_b[:, c.qk_nope_head_dim:])
  else:
    embed_q, unembed_out = w["self_attn.embed_q.weight"], w["self_attn.unembed_out.weight"]
  one_projection = w.get("self_attn.q_proj.weight") is not None
  rows = lambda m, order: take_rows(m, order) if isinstance(m, QuantizedWeight) else m[order]
  return LatentAttentionWeights(
    q_a=None if one_projection else w["self_attn.q_a_proj.weight"], q_a_norm=None if one_projection else w["self_attn.q_a_layernorm.weight"],
    q_b=rows(w["self_attn.q_proj.weight"] if one_projection else w["self_attn.q_b_proj.weight"], q_order),
    kv_a=rows(w["self_attn.kv_a_proj_with_mqa.weight"], kv_order), kv_a_norm=w["self_attn.kv_a_layernorm.weight"], embed_q=embed_q, unembed_out=unembed_out)


def layer_weights(weights: Dict[str, Weight], shard: Shard, config: LlamaConfig) -> Iterator[LayerWeights]:
  """The shard's layers, one at a time: an engine converts each before the next is fused, so a large model's fused
  copies never all exist at once beside the loaded weights. `config` says which optional parts the layers have."""
  norm = lambda w: w + np.float32(config.norm_weight_offset) if config.norm_weight_offset else w
  for i in range(shard.start_layer, shard.end_layer + 1):
    prefix = f"model.layers.{i}."
    w = LayerTensors(weights, prefix)
    parts = {role: norm(w[f"{name}.weight"]) for role, name in config.layer_norms}
    if config.qkv_bias:
      parts["qkv_bias"] = np.concatenate([w[f"self_attn.{p}_proj.bias"] for p in "qkv"])
    if config.o_bias:
      parts["o_bias"] = w["self_attn.o_proj.bias"]
    if config.qk_norm:
      parts.update(q_norm=norm(w["self_attn.q_norm.weight"]), k_norm=norm(w["self_attn.k_norm.weight"]))
    if config.attention_sinks:
      parts["sinks"] = w["self_attn.sinks"]
    if config.latent_attention:
      qkv, parts["latent"] = None, latent_attention_weights(w, prefix, config)
    elif w.get("self_attn.qkv_proj.weight") is not None:  # Phi-3 stores each fusion as one matrix already
      qkv = w["self_attn.qkv_proj.weight"]
    else:
      qkv = fused([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"], w["self_attn.v_proj.weight"]])
    if config.is_moe(i):
      parts.update(expert_weights(w, prefix, config))
      yield LayerWeights(qkv=qkv, o=w["self_attn.o_proj.weight"], gate_up=None, down=None, **parts)
      continue
    gate_up = w.get("mlp.gate_up_proj.weight")
    gate_up = fused([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]) if gate_up is None else gate_up
    yield LayerWeights(qkv=qkv, o=w["self_attn.o_proj.weight"], gate_up=gate_up, down=w["mlp.down_proj.weight"], **parts)


class LayerTensors:
  """One layer's tensors by their names within it."""

  def __init__(self, weights: Dict[str, Weight], prefix: str):
    self.weights, self.prefix = weights, prefix

  def __getitem__(self, name: str) -> Weight:
    return self.weights[self.prefix + name]

  def get(self, name: str) -> Optional[Weight]:
    return self.weights.get(self.prefix + name)


def expert_weights(w: LayerTensors, prefix: str, config: LlamaConfig) -> dict:
  """A mixture-of-experts layer's router and experts (LayerWeights' fields), each expert's gate/up fused as
  (2 * inter, hidden), gate rows first, from any layout checkpoints store them in: one matrix per expert
  (`experts.<e>.<gate>.weight`...); every expert's in one (in, out) tensor, gate and up columns interleaved
  (gpt-oss as transformers writes it: `experts.gate_up_proj`, `experts.down_proj` and their `_bias`), or the same
  as (experts, out, in) MXFP4 (gpt-oss as OpenAI ships it, `experts.gate_up_proj.weight` once loaded); or each
  projection of every expert stacked (experts, out, in), as mlx-lm writes them (`switch_mlp.gate_proj.weight`...;
  gpt-oss's `experts.<gate>.weight`...), float or quantized expert by expert. Quantized experts stay so (each
  expert's matrices views of the stack); a quantized router, a few rows, is dequantised."""
  block, gate, up, down = config.expert_names
  router = "router" if w.get(f"{block}.router.weight") is not None else "gate"
  parts = {"router": as_float(w[f"{block}.{router}.weight"])}
  if config.router_bias:
    parts["router_bias"] = w[f"{block}.router.bias"]
  elif config.router == "sigmoid_grouped":
    parts["score_correction"] = w[f"{block}.gate.e_score_correction_bias"]
  stacked_names = next(((f"{block}.{stack}.{g}", f"{block}.{stack}.{u}", f"{block}.{stack}.{d}")
                        for stack, (g, u, d) in (("switch_mlp", ("gate_proj", "up_proj", "down_proj")), ("experts", (gate, up, down)))
                        if w.get(f"{block}.{stack}.{g}.weight") is not None), None)
  if w.get(f"{block}.experts.gate_up_proj") is not None:
    stacked_gate_up, stacked_down = w[f"{block}.experts.gate_up_proj"], w[f"{block}.experts.down_proj"]  # (experts, in, out)
    gate_first = np.concatenate([np.arange(0, stacked_gate_up.shape[-1], 2), np.arange(1, stacked_gate_up.shape[-1], 2)])
    parts["experts"] = [(np.ascontiguousarray(gu.T[gate_first]), np.ascontiguousarray(d.T)) for gu, d in zip(stacked_gate_up, stacked_down)]
    if config.expert_bias:
      parts["expert_biases"] = [(gu[gate_first], d) for gu, d in zip(w[f"{block}.experts.gate_up_proj_bias"], w[f"{block}.experts.down_proj_bias"])]
  elif w.get(f"{block}.experts.gate_up_proj.weight") is not None:  # gpt-oss's MXFP4 (quantized.group_mxfp4_blocks): (experts, out, in), gate and up rows interleaved
    stacked_gate_up, stacked_down = w[f"{block}.experts.gate_up_proj.weight"], w[f"{block}.experts.down_proj.weight"]
    gate_first = np.concatenate([np.arange(0, stacked_gate_up.shape[-2], 2), np.arange(1, stacked_gate_up.shape[-2], 2)])
    rows = lambda m: take_rows(m, gate_first) if isinstance(m, QuantizedWeight) else np.ascontiguousarray(m[gate_first])
    parts["experts"] = [(rows(stacked_gate_up[e]), stacked_down[e]) for e in range(config.n_experts)]
    if config.expert_bias:
      parts["expert_biases"] = [(gu[gate_first], d) for gu, d in zip(w[f"{block}.experts.gate_up_proj_bias"], w[f"{block}.experts.down_proj_bias"])]
  elif stacked_names is not None:
    stacked = [w[f"{name}.weight"] for name in stacked_names]
    parts["experts"] = [(fused_one([stacked[0][e], stacked[1][e]]), stacked[2][e]) for e in range(config.n_experts)]
    if config.expert_bias:
      biases = [w[f"{name}.bias"] for name in stacked_names]
      parts["expert_biases"] = [(np.concatenate([g, u]), d) for g, u, d in zip(*biases)]
  else:
    parts["experts"] = [(fused_one([w[f"{block}.experts.{e}.{gate}.weight"], w[f"{block}.experts.{e}.{up}.weight"]]),
                         w[f"{block}.experts.{e}.{down}.weight"]) for e in range(config.n_experts)]
  if config.shared_expert_intermediate_size:
    parts["shared_expert"] = (fused_one([w[f"{block}.shared_experts.{gate}.weight"], w[f"{block}.shared_experts.{up}.weight"]]),
                              w[f"{block}.shared_experts.{down}.weight"])
  return parts


def rope_tables(config: LlamaConfig, layers: Sequence[int]) -> Tuple[List[np.ndarray], List[int]]:
  """The RoPE frequencies the layers use, each set once, and which set each layer uses: a model whose sliding
  layers rotate at their own base (Gemma 3) has two."""
  tables: List[np.ndarray] = []
  keys: List = []
  which = []
  for layer in layers:
    key = config.rope_of(layer)
    if key not in keys:
      keys.append(key)
      tables.append(rope_inv_freq(config, *key))
    which.append(keys.index(key))
  return tables, which


@dataclass
class Ends:
  """What a shard holds besides its layers: the token embedding on the first shard; the final norm and the output
  head on the last. The head is `lm_head.weight` where the checkpoint has one, else the embedding itself (tied
  weights); on a shard with both ends of a tied model `head is embed`, so an engine keeps one copy for both."""
  embed: Optional[Weight]  # (vocab, hidden)
  norm: Optional[np.ndarray]
  head: Optional[Weight]  # (vocab, hidden)

  @property
  def shared(self) -> bool:
    """One matrix serves the lookup and the head."""
    return self.head is not None and self.head is self.embed


def shard_ends(weights: Dict[str, Weight], shard: Shard, config: LlamaConfig) -> Ends:
  embed = weights.get("model.embed_tokens.weight")  # the loader reads it for a tied head's last shard too
  if not shard.is_last_layer():
    return Ends(embed=embed if shard.is_first_layer() else None, norm=None, head=None)
  norm = weights["model.norm.weight"] + np.float32(config.norm_weight_offset) if config.norm_weight_offset else weights["model.norm.weight"]
  return Ends(embed=embed if shard.is_first_layer() else None, norm=norm, head=weights.get("lm_head.weight", embed))


# --- a step ---

class StepRows:
  """One step's rows: each request's consecutive, in the order given. `sizes` (default: the input lengths) is the
  rows each request takes; an engine that pads a request's rows to a bucketed size passes those, and its padding
  rows continue the request's positions."""

  def __init__(self, lengths: Sequence[int], starts: Sequence[int], sizes: Optional[Sequence[int]] = None):
    sizes = lengths if sizes is None else sizes
    self.lengths = [int(n) for n in lengths]  # each request's input rows
    self.starts = [int(s) for s in starts]  # positions its cache holds before the step
    self.offsets = np.cumsum([0] + list(sizes))  # request r's rows start at offsets[r]
    self.rows = int(self.offsets[-1])
    self.positions = np.concatenate([np.arange(s, s + n) for s, n in zip(self.starts, sizes)])
    self.last_rows = self.offsets[:-1] + np.array(self.lengths) - 1  # each request's last input row: the one it is sampled from
    # the rows that hold input, not padding
    self.input_rows = np.concatenate([np.arange(a, a + n) for a, n in zip(self.offsets[:-1].tolist(), self.lengths)])

  def angles(self, inv_freq: np.ndarray, rows: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """RoPE's cos and sin for each row, float32 (rows, 1, head_dim // 2) to broadcast over heads; `rows` past the
    step's own (padding) take position 0."""
    positions = self.positions if rows is None else np.concatenate([self.positions, np.zeros(rows - self.rows, dtype=np.int64)])
    return rope_angles(positions, inv_freq)

  def split(self, h) -> List:
    """Each request's own rows of `h` (padding left out)."""
    return [h[a:a + n] for a, n in zip(self.offsets[:-1].tolist(), self.lengths)]


def rope_angles(positions: np.ndarray, inv_freq: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
  """RoPE's cos and sin at each of `positions`, float32 (len(positions), 1, head_dim // 2)."""
  angles = positions[:, None].astype(np.float32) * inv_freq[None, :]
  return np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]


def step_input(inputs: Sequence[np.ndarray], first_shard: bool, hidden_size: int) -> np.ndarray:
  """Every request's input, one after another: token ids (rows,) int64 on the first shard, else hidden states
  (rows, hidden) float32."""
  if first_shard:
    return np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in inputs])
  return np.concatenate([np.asarray(x, dtype=np.float32).reshape(-1, hidden_size) for x in inputs])


def in_caller_order(order: Sequence[int], outputs: Sequence) -> List:
  """Outputs computed for the requests in `order` (an engine's own order, e.g. by cache slot), back in the order the
  caller gave them."""
  unsorted: List = [None] * len(outputs)
  for i, r in enumerate(order):
    unsorted[r] = outputs[i]
  return unsorted


# --- mixtures of experts ---

def route(router_logits: np.ndarray, config: LlamaConfig, score_correction: Optional[np.ndarray] = None) -> Tuple[np.ndarray, np.ndarray]:
  """Each row's experts and their weights, (rows, k) each, by the model's rule (ModelConfig.router); ties go to the
  lower index, as torch.topk's on the CPU."""
  logits, k = router_logits.astype(np.float32), config.experts_per_token
  top_k = lambda values: np.argsort(-values, axis=-1, kind="stable")[:, :k]
  if config.router == "topk_softmax":
    chosen = top_k(logits)
    return chosen, softmax(np.take_along_axis(logits, chosen, axis=-1))
  if config.router == "sigmoid_grouped":
    scores = 1.0 / (1.0 + np.exp(-logits))
    choosing = scores if score_correction is None else scores + score_correction
    groups = choosing.reshape(len(choosing), config.n_expert_groups, -1)
    group_scores = np.sort(groups, axis=-1)[..., -2:].sum(axis=-1)  # each group by its two best
    searched = np.argsort(-group_scores, axis=-1, kind="stable")[:, :config.expert_groups_searched]
    hidden = np.ones(group_scores.shape, dtype=bool)
    np.put_along_axis(hidden, searched, False, axis=-1)
    chosen = top_k(np.where(hidden[..., None], -np.inf, groups).reshape(choosing.shape))
    weights = np.take_along_axis(scores, chosen, axis=-1)
    if config.normalize_expert_weights:
      weights /= weights.sum(axis=-1, keepdims=True) + 1e-20
    return chosen, weights * np.float32(config.routed_scaling_factor)
  probs = softmax(logits)
  chosen = top_k(probs)
  weights = np.take_along_axis(probs, chosen, axis=-1)
  if config.normalize_expert_weights:
    weights /= weights.sum(axis=-1, keepdims=True)
  return chosen, weights


def softmax(x: np.ndarray) -> np.ndarray:
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)

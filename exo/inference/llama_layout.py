"""What every Llama engine (numpy, tinygrad, MLX) lays out the same way, whatever array library computes the model.

Weights: which a shard holds, each layer's grouped for its fused products (q/k/v as one, gate/up as one), and the one
rule for the output head. A step: where each request's rows sit among the step's rows, their positions and RoPE
angles, and the row each request is sampled from. Everything here is numpy on the host; each engine's model class
(exo/inference/<backend>/llama.py) turns it into its own arrays and holds only the computation."""
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from exo.inference.quantized import QuantizedWeight, stack_rows
from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig

# A matrix as the loader gives it: float32 (out, in), or MLX-quantized for an engine that keeps it so.
Weight = Union[np.ndarray, QuantizedWeight]


def rope_inv_freq(config: LlamaConfig, theta: Optional[float] = None, scaling: Optional[dict] = None) -> np.ndarray:
  """Inverse RoPE frequencies (head_dim // 2,), scaled as the model asks (llama3's by wavelength, or linear); `theta`
  and `scaling` in place of the model's own (a sliding layer's, ModelConfig.rope_of)."""
  theta, scaling = (config.rope_theta, config.rope_scaling) if theta is None else (theta, scaling)
  inv_freq = 1.0 / (theta ** (np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim))
  scaling = scaling or {}
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
  experts: Optional[List[Tuple[np.ndarray, np.ndarray]]] = None  # each expert's fused gate/up (2 * inter, hidden) and down


def layer_weights(weights: Dict[str, Weight], shard: Shard, config: LlamaConfig) -> Iterator[LayerWeights]:
  """The shard's layers, one at a time: an engine converts each before the next is fused, so a large model's fused
  copies never all exist at once beside the loaded weights. `config` says which optional parts the layers have."""
  norm = lambda w: w + np.float32(config.norm_weight_offset) if config.norm_weight_offset else w
  for i in range(shard.start_layer, shard.end_layer + 1):
    prefix = f"model.layers.{i}."
    w = lambda name: weights[prefix + name]
    parts = {role: norm(w(f"{name}.weight")) for role, name in config.layer_norms}
    if config.qkv_bias:
      parts["qkv_bias"] = np.concatenate([w(f"self_attn.{p}_proj.bias") for p in "qkv"])
    if config.o_bias:
      parts["o_bias"] = w("self_attn.o_proj.bias")
    if config.qk_norm:
      parts.update(q_norm=norm(w("self_attn.q_norm.weight")), k_norm=norm(w("self_attn.k_norm.weight")))
    # Phi-3 stores each fusion as one matrix already
    qkv = w("self_attn.qkv_proj.weight") if prefix + "self_attn.qkv_proj.weight" in weights else \
        fused([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")])
    if config.is_moe(i):
      block, gate, up, down = config.expert_names
      if any(isinstance(w(name), QuantizedWeight) for name in (f"{block}.gate.weight", f"{block}.experts.0.{gate}.weight")):
        raise ValueError(f"{prefix}{block}: quantized experts are not implemented (use a float checkpoint)")
      parts["router"] = w(f"{block}.gate.weight")
      parts["experts"] = [(np.concatenate([w(f"{block}.experts.{e}.{gate}.weight"), w(f"{block}.experts.{e}.{up}.weight")]),
                           w(f"{block}.experts.{e}.{down}.weight")) for e in range(config.n_experts)]
      yield LayerWeights(qkv=qkv, o=w("self_attn.o_proj.weight"), gate_up=None, down=None, **parts)
      continue
    gate_up = w("mlp.gate_up_proj.weight") if prefix + "mlp.gate_up_proj.weight" in weights else fused([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")])
    yield LayerWeights(qkv=qkv, o=w("self_attn.o_proj.weight"), gate_up=gate_up, down=w("mlp.down_proj.weight"), **parts)


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
    angles = positions[:, None].astype(np.float32) * inv_freq[None, :]
    return np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

  def split(self, h) -> List:
    """Each request's own rows of `h` (padding left out)."""
    return [h[a:a + n] for a, n in zip(self.offsets[:-1].tolist(), self.lengths)]


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

def route(router_logits: np.ndarray, config: LlamaConfig) -> Tuple[np.ndarray, np.ndarray]:
  """Each row's experts and their weights, (rows, k) each: softmax over every expert, the k most probable (ties to
  the lower index, as torch.topk on the CPU), renormalised over those k where the model says so."""
  logits = router_logits.astype(np.float32)
  probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
  probs /= probs.sum(axis=-1, keepdims=True)
  chosen = np.argsort(-probs, axis=-1, kind="stable")[:, :config.experts_per_token]
  weights = np.take_along_axis(probs, chosen, axis=-1)
  if config.normalize_expert_weights:
    weights /= weights.sum(axis=-1, keepdims=True)
  return chosen, weights

"""The decoder a model family describes: one dataclass every engine reads, and the readers of config.json fields that
several families share (RoPE, sliding windows, activations).

A config.json field that changes the model's math is either honoured here or refused with UnsupportedModel naming
it; none is silently ignored, since a model computed without it answers plausible but wrong tokens."""
import math
from dataclasses import dataclass
from typing import Optional, Tuple


class UnsupportedModel(ValueError):
  """The model needs something no engine here computes. `field` names the config.json field (dotted within a
  nested object) at fault, so the API can answer a 400 that says which."""

  def __init__(self, field: str, message: str):
    super().__init__(f"{field}: {message}")
    self.field = field


@dataclass(frozen=True)
class ModelConfig:
  hidden_size: int
  intermediate_size: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  vocab_size: int
  head_dim: int
  rms_norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  rope_scaling: Optional[dict] = None  # {"rope_type": "llama3" | "linear", "factor": ..., ...}; GGUF: {"freq_factors": [...]}
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 4096
  dtype: str = "float32"  # the checkpoint's own float precision ("bfloat16", "float16"), for devices that compute in it
  model_type: str = "llama"
  qkv_bias: bool = False  # q, k and v projections carry biases (Qwen2; Llama with attention_bias)
  o_bias: bool = False  # the output projection carries a bias (Llama with attention_bias)
  qk_norm: Optional[str] = None  # RMS norm of queries and keys before RoPE: "head" over each head's (Qwen3, Gemma 3),
  # "projection" over the whole projection's (OLMo 2)
  # Which RMS norms a layer has, as (role, the checkpoint's name): roles attn_norm and mlp_norm normalise the input of
  # attention and of the MLP; post_attn_norm and post_mlp_norm their outputs, before the residual add.
  layer_norms: Tuple[Tuple[str, str], ...] = (("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"))
  norm_weight_offset: float = 0.0  # Gemma's norms scale by (1 + weight): the loader adds this to every norm weight
  activation: str = "silu"  # of the gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
  embedding_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(hidden); Granite: embedding_multiplier)
  attention_scale: Optional[float] = None  # scores times this; None: 1 / sqrt(head_dim)
  residual_scale: float = 1.0  # attention's and the MLP's outputs times this before the residual add (Granite)
  logits_scale: float = 1.0  # the head's logits times this (Granite: 1 / logits_scaling)
  attn_softcap: Optional[float] = None  # scores become cap * tanh(scores / cap) (Gemma 2)
  final_softcap: Optional[float] = None  # logits likewise
  sliding_window: Optional[int] = None  # a sliding layer's query sees the last this many positions, itself included
  sliding_layers: Tuple[int, ...] = ()  # which layers slide (Gemma 2 and 3), the others attend to every position
  sliding_rope: Optional[Tuple[float, Optional[dict]]] = None  # (theta, scaling) of the sliding layers, where theirs differs
  # Mixture of experts: in the layers listed, the MLP is n_experts gated MLPs of expert_intermediate_size, of which a
  # router picks experts_per_token for each token (softmax over all experts, the top k, renormalised over those k
  # when normalize_expert_weights), their outputs summed by those weights.
  n_experts: int = 0
  experts_per_token: int = 0
  expert_intermediate_size: int = 0
  normalize_expert_weights: bool = True
  moe_layers: Tuple[int, ...] = ()
  expert_names: Tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")  # the block; each expert's gate, up and down
  # How the router's logits become each row's experts and weights (llama_layout.route): "softmax" as above;
  # "topk_softmax" the k largest logits, softmax over those (gpt-oss); "sigmoid_grouped" (DeepSeek-V3) sigmoid
  # scores, plus the checkpoint's correction bias for choosing only: the n_expert_groups groups ranked by their two
  # best, the top expert_groups_searched searched for the k best, whose uncorrected scores are the weights
  # (renormalised when normalize_expert_weights), times routed_scaling_factor.
  router: str = "softmax"
  router_bias: bool = False  # the router's logits carry a bias (gpt-oss)
  expert_bias: bool = False  # each expert's gate/up and down carry biases (gpt-oss)
  n_expert_groups: int = 1
  expert_groups_searched: int = 1
  routed_scaling_factor: float = 1.0
  shared_expert_intermediate_size: int = 0  # a gated MLP every row goes through beside its experts (DeepSeek)
  # gpt-oss's experts' SwiGLU: gate clamped above at swiglu_limit and up to +-swiglu_limit, then
  # (up + 1) * gate * sigmoid(swiglu_alpha * gate)
  swiglu_limit: Optional[float] = None
  swiglu_alpha: float = 1.0
  attention_sinks: bool = False  # a learned logit per head joins each softmax's denominator (gpt-oss)
  # Multi-head latent attention (DeepSeek V2/V3), where kv_lora_rank > 0: queries through a rank q_lora_rank
  # bottleneck (0: one projection), keys and values from a normalised latent of kv_lora_rank per position, each
  # head's key its qk_nope_head_dim from the latent and qk_rope_head_dim turned by RoPE, shared by all heads. The
  # cache holds the latent and the turned key part: kv_lora_rank + qk_rope_head_dim values a position and layer.
  # head_dim is qk_nope_head_dim + qk_rope_head_dim (the query-key width).
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleaved: bool = False  # the checkpoint's RoPE dimensions are stored as interleaved pairs (DeepSeek's rope_interleave)

  @property
  def latent_attention(self) -> bool:
    return self.kv_lora_rank > 0

  @property
  def rope_dim(self) -> int:
    """The dimensions of a query or key head RoPE turns."""
    return self.qk_rope_head_dim if self.latent_attention else self.head_dim

  @property
  def kv_values_per_position(self) -> int:
    """Values a layer's KV cache keeps per position: a key and a value per KV head, or MLA's latent and RoPE key."""
    return self.kv_lora_rank + self.qk_rope_head_dim if self.latent_attention else 2 * self.n_kv_heads * self.head_dim

  def is_moe(self, layer: int) -> bool:
    return layer in self.moe_layers

  def attention_parameters(self) -> int:
    """The weights of one layer's attention: q, k, v and o; or latent attention's projections."""
    h, heads = self.hidden_size, self.n_heads
    if not self.latent_attention:
      return h * self.head_dim * (2 * heads + 2 * self.n_kv_heads)
    queries = heads * self.head_dim * (self.q_lora_rank or h) + (h * self.q_lora_rank if self.q_lora_rank else 0)
    latent = h * self.kv_values_per_position + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
    return queries + latent + heads * self.v_head_dim * h

  def mlp_parameters(self) -> int:
    """The weights of every layer's MLP together, each expert's counted (a node holds them all)."""
    dense = 3 * self.hidden_size * self.intermediate_size
    experts = self.n_experts * (3 * self.hidden_size * self.expert_intermediate_size + self.hidden_size)  # and the router
    experts += 3 * self.hidden_size * self.shared_expert_intermediate_size
    return sum(experts if self.is_moe(layer) else dense for layer in range(self.n_layers))

  def layer_parameters(self) -> int:
    """Every layer's weights together, as the checkpoint holds them: attention with its norms and biases, and every
    MLP (each expert's, with the router's bias and the experts' where the model has them)."""
    h, heads, kv_heads, hd = self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim
    layer = self.attention_parameters() + h * len(self.layer_norms)
    layer += (heads + 2 * kv_heads) * hd if self.qkv_bias else 0
    layer += h if self.o_bias else 0
    layer += {"head": 2 * hd, "projection": (heads + kv_heads) * hd}.get(self.qk_norm, 0)
    layer += heads if self.attention_sinks else 0
    layer += self.q_lora_rank + self.kv_lora_rank if self.latent_attention else 0  # the two latents' norms
    per_expert = (self.router_bias or self.router == "sigmoid_grouped") + (2 * self.expert_intermediate_size + h if self.expert_bias else 0)
    return self.n_layers * layer + self.mlp_parameters() + len(self.moe_layers) * self.n_experts * per_expert

  def slides(self, layer: int) -> bool:
    return self.sliding_window is not None and layer in self.sliding_layers

  def rope_of(self, layer: int) -> Tuple[float, Optional[dict]]:
    """(theta, scaling) a layer's RoPE uses."""
    return self.sliding_rope if self.sliding_rope is not None and self.slides(layer) else (self.rope_theta, self.rope_scaling)


def check_engine(config: ModelConfig, engine_classname: str) -> None:
  """UnsupportedModel, naming the config field, for a model the engine does not compute (the others run every
  family): told before anything loads, so that the API can answer 400."""
  if engine_classname != "TinygradDynamicShardInferenceEngine":
    return
  if config.moe_layers:
    unusual = [what for what, present in (("routed by " + config.router, config.router != "softmax"), ("a router bias", config.router_bias),
                                          ("expert biases", config.expert_bias), ("clamped SwiGLU", config.swiglu_limit is not None),
                                          ("shared experts", config.shared_expert_intermediate_size > 0)) if present]
    if unusual:  # tinygrad computes Mixtral's and Qwen3-MoE's experts: softmax routing, plain gated MLPs
      raise refuse("num_experts_per_tok", config.experts_per_token,
                   f"(a mixture of experts: {', '.join(unusual)}) is not implemented by the tinygrad engine (use numpy or mlx)")
  if config.latent_attention:
    raise refuse("kv_lora_rank", config.kv_lora_rank, "(multi-head latent attention) is not implemented by the tinygrad engine (use numpy or mlx)")
  if config.attention_sinks:
    raise refuse("model_type", config.model_type, "(attention sinks) is not implemented by the tinygrad engine (use numpy or mlx)")


def refuse(field: str, value, why: str = "is not implemented by exo's engines") -> UnsupportedModel:
  return UnsupportedModel(field, f"{value!r} {why}")


def rope_parameters(config_json: dict, layer_type: Optional[str] = None) -> Tuple[float, Optional[dict]]:
  """(theta, scaling) from either config form: transformers 4's top-level `rope_theta` and `rope_scaling`, or
  transformers 5's `rope_parameters` {rope_type, rope_theta, factor, ...}, or its one set per layer type (Gemma 3:
  `layer_type` picks one). Scaling is None for plain RoPE; a RoPE type other than default, linear or llama3 is
  refused, as is RoPE over part of each head. Yarn's scaling keeps `attention_factor`, what it multiplies cos and
  sin by (yarn_attention_factor)."""
  if config_json.get("rope_parameters") is not None:
    field, params = "rope_parameters", dict(config_json["rope_parameters"])
    if params and all(isinstance(v, dict) for v in params.values()):  # one set per layer type
      if layer_type not in params:
        raise refuse(field, sorted(params), "(RoPE parameters per layer type) is not implemented for this model type")
      field, params = f"{field}.{layer_type}", dict(params[layer_type])
    theta = params.get("rope_theta", config_json.get("rope_theta", 10000.0))
  else:
    field, params = "rope_scaling", dict(config_json.get("rope_scaling") or {})
    theta = config_json.get("rope_theta", 10000.0)
  for partial in ("partial_rotary_factor",):
    value = params.get(partial, config_json.get(partial, 1.0))
    if value not in (None, 1, 1.0):
      raise refuse(partial if partial in config_json else f"{field}.{partial}", value)
  key = "rope_type" if "rope_type" in params else "type"
  rope_type = params.get(key) or "default"
  if rope_type == "default":
    return float(theta), None
  if rope_type not in ("linear", "llama3", "yarn"):
    raise refuse(f"{field}.{key}", rope_type)
  params.pop("rope_theta", None)
  if rope_type == "yarn":
    for needed in ("factor", "original_max_position_embeddings"):
      if params.get(needed) is None:
        raise refuse(f"{field}.{needed}", None, "(yarn without it) is not implemented by exo's engines")
    params["attention_factor"] = yarn_attention_factor(params)
  return float(theta), {**params, "rope_type": rope_type}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """Yarn's attention temperature for a context `factor` times the original."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(params: dict) -> float:
  """What yarn multiplies RoPE's cos and sin by (so every query-key product of turned dimensions by its square):
  the config's `attention_factor`, else the ratio of the two mscales DeepSeek gives, else mscale of the factor."""
  if params.get("attention_factor") is not None:
    return float(params["attention_factor"])
  factor, mscale, mscale_all_dim = float(params["factor"]), params.get("mscale"), params.get("mscale_all_dim")
  if mscale and mscale_all_dim:
    return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
  return yarn_mscale(factor)


def rope_attention_factor(scaling: Optional[dict]) -> float:
  """The factor RoPE's scaling multiplies cos and sin by: 1 but for yarn."""
  return float((scaling or {}).get("attention_factor", 1.0))


def context_length(config_json: dict) -> int:
  """The positions the model answers for. A sliding window narrower than the model's context limits it to the
  window: within it, windowed attention and full attention are the same computation, and beyond it the engines
  would need the window, which they do not yet keep."""
  context = int(config_json.get("max_position_embeddings") or 4096)
  window = config_json.get("sliding_window")
  slides = config_json.get("use_sliding_window", True) and any(t != "full_attention" for t in config_json.get("layer_types") or ["sliding_attention"])
  if window and slides and int(window) < context:
    return int(window)
  return context


def check_activation(config_json: dict, field: str = "hidden_act", expected: str = "silu") -> None:
  value = config_json.get(field, expected)
  if value != expected:
    raise refuse(field, value, f"is not implemented for {config_json.get('model_type')!r} (only {expected!r})")


def dense_decoder(config_json: dict, **features) -> ModelConfig:
  """The fields every Llama-shaped family shares, from config.json; `features` are the family's own (and replace
  what is read here: a family with its own RoPE or context rule passes them)."""
  hidden, n_heads = config_json["hidden_size"], config_json["num_attention_heads"]
  if "rope_theta" not in features:
    features["rope_theta"], features["rope_scaling"] = rope_parameters(config_json)
  factor = rope_attention_factor(features["rope_scaling"])
  if features.get("sliding_rope") is not None and rope_attention_factor(features["sliding_rope"][1]) != factor:
    raise refuse("rope_parameters.sliding_attention", features["sliding_rope"][1], "(a yarn factor of its own) is not implemented by exo's engines")
  if factor != 1.0 and not features.get("kv_lora_rank"):  # (MLA turns part of each head: deepseek_v3.py)
    # yarn's cos and sin factor is on every dimension of a head's queries and keys: the scores times its square
    scale = features.get("attention_scale") or 1.0 / math.sqrt(config_json.get("head_dim") or hidden // n_heads)
    features["attention_scale"] = scale * factor * factor
  if "activation" not in features:
    check_activation(config_json)
  if config_json.get("mlp_bias"):
    raise refuse("mlp_bias", True)
  fields = dict(
    hidden_size=hidden, intermediate_size=config_json["intermediate_size"], n_layers=config_json["num_hidden_layers"],
    n_heads=n_heads, n_kv_heads=config_json.get("num_key_value_heads") or n_heads, vocab_size=config_json["vocab_size"],
    head_dim=config_json.get("head_dim") or hidden // n_heads, rms_norm_eps=config_json.get("rms_norm_eps", 1e-5),
    tie_word_embeddings=bool(config_json.get("tie_word_embeddings", False)), max_position_embeddings=context_length(config_json),
    dtype=str(config_json.get("torch_dtype") or config_json.get("dtype") or "float32"), model_type=config_json.get("model_type") or "llama")
  return ModelConfig(**{**fields, **features})

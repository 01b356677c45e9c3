"""The decoder a model family describes: one dataclass every engine reads, and the readers of config.json fields that
several families share (RoPE, sliding windows, activations).

A config.json field that changes the model's math is either honoured here or refused with UnsupportedModel naming
it; none is silently ignored, since a model computed without it answers plausible but wrong tokens."""
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

  def is_moe(self, layer: int) -> bool:
    return layer in self.moe_layers

  def mlp_parameters(self) -> int:
    """The weights of every layer's MLP together, each expert's counted (a node holds them all)."""
    dense = 3 * self.hidden_size * self.intermediate_size
    experts = self.n_experts * (3 * self.hidden_size * self.expert_intermediate_size + self.hidden_size)  # and the router
    return sum(experts if self.is_moe(layer) else dense for layer in range(self.n_layers))

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
    raise refuse("num_experts_per_tok", config.experts_per_token, "(a mixture of experts) is not implemented by the tinygrad engine (use numpy or mlx)")


def refuse(field: str, value, why: str = "is not implemented by exo's engines") -> UnsupportedModel:
  return UnsupportedModel(field, f"{value!r} {why}")


def rope_parameters(config_json: dict, layer_type: Optional[str] = None) -> Tuple[float, Optional[dict]]:
  """(theta, scaling) from either config form: transformers 4's top-level `rope_theta` and `rope_scaling`, or
  transformers 5's `rope_parameters` {rope_type, rope_theta, factor, ...}, or its one set per layer type (Gemma 3:
  `layer_type` picks one). Scaling is None for plain RoPE; a RoPE type other than default, linear or llama3 is
  refused, as is RoPE over part of each head."""
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
  if rope_type not in ("linear", "llama3"):
    raise refuse(f"{field}.{key}", rope_type)
  params.pop("rope_theta", None)
  return float(theta), {**params, "rope_type": rope_type}


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

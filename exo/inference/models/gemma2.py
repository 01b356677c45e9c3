"""Gemma 2: norms before and after attention and the MLP, each scaling by (1 + weight); embeddings scaled by
sqrt(hidden); GeGLU; scores scaled by query_pre_attn_scalar and soft-capped, as are the logits; every other layer
attends over a sliding window."""
from exo.inference.models.config import ModelConfig, check_activation, dense_decoder, refuse

GEMMA_NORMS = (("attn_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
               ("mlp_norm", "pre_feedforward_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm"))


def sliding_layers(config_json: dict, every: int) -> tuple:
  """The layers config.json's `layer_types` (transformers 5) says slide; without it every layer but each
  `every`-th, as transformers 4 computed it."""
  n_layers = config_json["num_hidden_layers"]
  types = config_json.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
  for t in set(types) - {"sliding_attention", "full_attention"}:
    raise refuse("layer_types", t)
  return tuple(i for i, t in enumerate(types) if t == "sliding_attention")


def gemma_features(config_json: dict, pattern: int) -> dict:
  check_activation(config_json, "hidden_activation", "gelu_pytorch_tanh")
  if config_json.get("hidden_activation") is None:
    check_activation(config_json, "hidden_act", "gelu_pytorch_tanh")
  if config_json.get("use_bidirectional_attention"):
    raise refuse("use_bidirectional_attention", True)
  head_dim = config_json.get("head_dim") or config_json["hidden_size"] // config_json["num_attention_heads"]
  bias = bool(config_json.get("attention_bias", False))
  return dict(activation="gelu_tanh", layer_norms=GEMMA_NORMS, norm_weight_offset=1.0, embedding_scale=config_json["hidden_size"] ** 0.5,
              attention_scale=float(config_json.get("query_pre_attn_scalar") or head_dim) ** -0.5, qkv_bias=bias, o_bias=bias,
              attn_softcap=config_json.get("attn_logit_softcapping"), final_softcap=config_json.get("final_logit_softcapping"),
              sliding_window=config_json.get("sliding_window"), sliding_layers=sliding_layers(config_json, pattern),
              max_position_embeddings=int(config_json.get("max_position_embeddings") or 8192),
              tie_word_embeddings=bool(config_json.get("tie_word_embeddings", True)))  # Gemma's default: a config may leave it out


def config(config_json: dict) -> ModelConfig:
  return dense_decoder(config_json, **gemma_features(config_json, 2))

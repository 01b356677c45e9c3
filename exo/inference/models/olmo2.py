"""OLMo 2: Llama's decoder with its norms after attention and the MLP instead of before, and queries and keys
normalised over the whole projection before RoPE."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  bias = bool(config_json.get("attention_bias", False))
  return dense_decoder(config_json, qkv_bias=bias, o_bias=bias, qk_norm="projection",
                       layer_norms=(("post_attn_norm", "post_attention_layernorm"), ("post_mlp_norm", "post_feedforward_layernorm")))

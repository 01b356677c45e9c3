"""Granite (IBM Granite 3.x dense): Llama's decoder with its four multipliers, on the embeddings, the attention
scores, each residual branch and the logits."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  bias = bool(config_json.get("attention_bias", False))
  return dense_decoder(config_json, qkv_bias=bias, o_bias=bias, embedding_scale=float(config_json.get("embedding_multiplier", 1.0)),
                       attention_scale=float(config_json.get("attention_multiplier", 1.0)),
                       residual_scale=float(config_json.get("residual_multiplier", 1.0)),
                       logits_scale=1.0 / float(config_json.get("logits_scaling", 1.0)))

"""Llama (1, 2, 3, 3.1, 3.2; SmolLM): the dense decoder as it is. `attention_bias` puts biases on q, k, v and o."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  bias = bool(config_json.get("attention_bias", False))
  return dense_decoder(config_json, qkv_bias=bias, o_bias=bias)

"""Qwen2 and Qwen2.5 (and the DeepSeek-R1 Qwen distills): Llama's decoder with biases on q, k and v."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  return dense_decoder(config_json, qkv_bias=True)

"""Qwen3 (dense): Llama's decoder with an RMS norm over each head's queries and keys before RoPE."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  bias = bool(config_json.get("attention_bias", False))
  return dense_decoder(config_json, qk_norm="head", qkv_bias=bias, o_bias=bias)

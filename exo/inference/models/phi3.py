"""Phi-3 and Phi-4 (dense): Llama's decoder with q/k/v and gate/up each stored as one matrix (`qkv_proj`,
`gate_up_proj`), which the engines fuse anyway. Phi-3.5's longrope and Phi-4-mini's partial RoPE are refused."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  return dense_decoder(config_json)

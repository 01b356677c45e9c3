"""Mistral (7B v0.1-v0.3, Nemo, Small): Llama's decoder; v0.1's sliding window limits the context it answers for."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  return dense_decoder(config_json)

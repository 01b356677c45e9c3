"""Mistral (7B v0.1-v0.3, Nemo, Small): Llama's decoder. v0.1's `sliding_window` makes every layer slide: a query
sees the last that many positions, over the model's whole context."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  window = config_json.get("sliding_window")
  if not window:
    return dense_decoder(config_json)
  return dense_decoder(config_json, sliding_window=int(window), sliding_layers=tuple(range(config_json["num_hidden_layers"])),
                       max_position_embeddings=int(config_json.get("max_position_embeddings") or 4096))

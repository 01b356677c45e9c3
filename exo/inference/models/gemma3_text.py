"""Gemma 3 (text; the 1B checkpoint, and the language model of the others): Gemma 2's layer with each head's queries
and keys normalised before RoPE, five sliding layers to each full one, and the sliding layers' own RoPE."""
from exo.inference.models.config import ModelConfig, dense_decoder, rope_parameters
from exo.inference.models.gemma2 import gemma_features


def config(config_json: dict) -> ModelConfig:
  if isinstance(next(iter((config_json.get("rope_parameters") or {"": None}).values())), dict):  # transformers 5: per layer type
    rope, sliding_rope = rope_parameters(config_json, "full_attention"), rope_parameters(config_json, "sliding_attention")
  else:  # transformers 4: the sliding layers' base in rope_local_base_freq, unscaled
    rope, sliding_rope = rope_parameters(config_json), (float(config_json.get("rope_local_base_freq", 10000.0)), None)
  features = gemma_features(config_json, int(config_json.get("sliding_window_pattern") or config_json.get("_sliding_window_pattern") or 6))
  return dense_decoder(config_json, **features, qk_norm="head", rope_theta=rope[0], rope_scaling=rope[1], sliding_rope=sliding_rope)

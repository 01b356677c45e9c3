"""Gemma 3 4B and larger (Gemma3ForConditionalGeneration): a Gemma 3 text model (gemma3_text.py) under `text_config`,
beside a vision tower and its projector. exo serves the text model; the vision weights are never read.

The nested config leaves out what transformers' Gemma3TextConfig defaults (the 4B's gives no head counts, RoPE base
or head width), so those defaults fill it, as transformers reads it."""
from typing import Optional

from exo.inference.models import gemma3_text
from exo.inference.models.config import ModelConfig

# Gemma3TextConfig's defaults (transformers 4 form) for the fields that shape the model or its math
TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0, attention_bias=False,
                     query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
                     attn_logit_softcapping=None, tie_word_embeddings=True)
# where the two transformers versions keep the text model's weights, and what they are called in a text-only checkpoint
TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."), ("language_model.lm_head.", "lm_head."))
OTHER_PARTS = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def text_config(config_json: dict) -> dict:
  """The text model's config.json, as a gemma3_text checkpoint would give it."""
  text = {**TEXT_DEFAULTS, **(config_json.get("text_config") or {})}
  if "vocab_size" not in (config_json.get("text_config") or {}) and config_json.get("vocab_size"):
    text["vocab_size"] = config_json["vocab_size"]
  for shared in ("tie_word_embeddings", "torch_dtype", "dtype"):  # kept at the top level
    if shared in config_json and shared not in (config_json.get("text_config") or {}):
      text[shared] = config_json[shared]
  if text.get("rope_parameters") is not None:  # transformers 5 form: its RoPE parameters hold the bases
    for old in ("rope_theta", "rope_local_base_freq"):
      if old not in (config_json.get("text_config") or {}):
        text.pop(old)
  return {**text, "model_type": "gemma3_text"}


def config(config_json: dict) -> ModelConfig:
  return gemma3_text.config(text_config(config_json))


def text_weight_name(name: str) -> Optional[str]:
  """A multimodal checkpoint's tensor name as the text model alone calls it; None for the vision tower's and the
  projector's, which exo does not load. Other names are returned as they are."""
  if name.startswith(OTHER_PARTS):
    return None
  for prefix, text_prefix in TEXT_PREFIXES:
    if name.startswith(prefix):
      return text_prefix + name[len(prefix):]
  return name

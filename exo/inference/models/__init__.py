"""The model families exo runs, one module each: what its config.json means as a ModelConfig (config.py), the one
description every engine computes from. A family not listed is refused by name."""
from exo.inference.models import deepseek_v3, gemma2, gemma3, gemma3_text, gpt_oss, granite, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3, qwen3_moe
from exo.inference.models.config import ModelConfig, UnsupportedModel, refuse

FAMILIES = {"llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "gemma2": gemma2, "gemma3_text": gemma3_text,
            "gemma3": gemma3, "phi3": phi3, "granite": granite, "olmo2": olmo2, "mixtral": mixtral, "qwen3_moe": qwen3_moe,
            "gpt_oss": gpt_oss, "deepseek_v3": deepseek_v3}


def model_config(config_json: dict) -> ModelConfig:
  """The decoder a Hugging Face config.json describes; UnsupportedModel naming the field it cannot honour."""
  model_type = config_json.get("model_type")
  archs = config_json.get("architectures") or []
  if model_type is None and (not archs or any(a.startswith("Llama") for a in archs)):
    model_type = "llama"
  family = FAMILIES.get(model_type)
  if family is None:
    raise refuse("model_type", model_type, f"is not supported (exo runs: {', '.join(sorted(FAMILIES))})")
  return family.config(config_json)


__all__ = ["FAMILIES", "ModelConfig", "UnsupportedModel", "model_config"]

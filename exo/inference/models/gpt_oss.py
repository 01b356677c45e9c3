"""gpt-oss (20b, 120b): sliding-window layers (128 positions) alternating with full ones, a learned sink logit per
head in every softmax, biases on q/k/v/o, yarn RoPE, and in every layer a mixture of experts with biases whose
router takes the top k logits and a softmax over those, each expert a SwiGLU clamped at swiglu_limit.

OpenAI's own repositories store the experts in MXFP4 (exo/inference/quantized.py's group_mxfp4_blocks reads it)."""
from exo.inference.models.config import ModelConfig, dense_decoder, refuse
from exo.inference.models.gemma2 import sliding_layers


def config(config_json: dict) -> ModelConfig:
  method = (config_json.get("quantization_config") or {}).get("quant_method")
  if method not in (None, "mxfp4"):
    raise refuse("quantization_config.quant_method", method, "is not implemented for gpt-oss (only its own mxfp4, or mlx-lm's quantization)")
  bias = bool(config_json.get("attention_bias", True))
  n_layers = config_json["num_hidden_layers"]
  return dense_decoder(config_json, qkv_bias=bias, o_bias=bias, attention_sinks=True, sliding_window=config_json.get("sliding_window"),
                       sliding_layers=sliding_layers(config_json, 2), max_position_embeddings=int(config_json.get("max_position_embeddings") or 131072),
                       n_experts=int(config_json["num_local_experts"]), experts_per_token=int(config_json["num_experts_per_tok"]),
                       expert_intermediate_size=int(config_json["intermediate_size"]), moe_layers=tuple(range(n_layers)), router="topk_softmax",
                       router_bias=True, expert_bias=True, swiglu_limit=float(config_json.get("swiglu_limit", 7.0)),
                       swiglu_alpha=float(config_json.get("swiglu_alpha", 1.702)))

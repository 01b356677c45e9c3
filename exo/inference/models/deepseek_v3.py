"""DeepSeek-V3 and R1 (and V2's layout): multi-head latent attention (ModelConfig.latent_attention: queries through a
low-rank bottleneck, keys and values from a compressed latent the cache holds instead of them, RoPE on a part of
each head that all heads share, stored as interleaved pairs), its yarn RoPE scaling the scores by mscale_all_dim as
well; the first `first_k_dense_replace` layers dense, the others a mixture of experts with shared experts beside
them, routed by sigmoid scores over groups of experts with a correction bias (ModelConfig.router
"sigmoid_grouped").

DeepSeek's own repositories store FP8 weights, which are refused here (a bfloat16 conversion loads)."""
import math

from exo.inference.models.config import ModelConfig, dense_decoder, refuse, rope_parameters, yarn_mscale


def config(config_json: dict) -> ModelConfig:
  quantization = config_json.get("quantization_config") or {}
  if quantization.get("quant_method") == "fp8":
    raise refuse("quantization_config.quant_method", "fp8", "(DeepSeek's block-scaled FP8 weights) is not implemented yet (use a bfloat16 checkpoint)")
  for field, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
    if config_json.get(field, expected) != expected:
      raise refuse(field, config_json[field])
  if config_json.get("attention_bias"):
    raise refuse("attention_bias", True)
  n_heads, nope, rope = config_json["num_attention_heads"], int(config_json["qk_nope_head_dim"]), int(config_json["qk_rope_head_dim"])
  theta, scaling = rope_parameters(config_json)
  scale = (nope + rope) ** -0.5
  if scaling and scaling.get("mscale_all_dim"):  # DeepSeek's yarn: the scores' temperature on every dimension too
    scale *= yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
  n_experts, first_dense = int(config_json.get("n_routed_experts") or 0), int(config_json.get("first_k_dense_replace") or 0)
  inter = int(config_json["moe_intermediate_size"])
  return dense_decoder(config_json, rope_theta=theta, rope_scaling=scaling, head_dim=nope + rope, n_kv_heads=n_heads, attention_scale=scale,
                       kv_lora_rank=int(config_json["kv_lora_rank"]), q_lora_rank=int(config_json.get("q_lora_rank") or 0), qk_nope_head_dim=nope,
                       qk_rope_head_dim=rope, v_head_dim=int(config_json["v_head_dim"]), rope_interleaved=bool(config_json.get("rope_interleave", True)),
                       n_experts=n_experts, experts_per_token=int(config_json["num_experts_per_tok"]), expert_intermediate_size=inter,
                       normalize_expert_weights=bool(config_json.get("norm_topk_prob", True)), router="sigmoid_grouped",
                       moe_layers=tuple(i for i in range(config_json["num_hidden_layers"]) if n_experts and i >= first_dense),
                       n_expert_groups=int(config_json.get("n_group") or 1), expert_groups_searched=int(config_json.get("topk_group") or 1),
                       routed_scaling_factor=float(config_json.get("routed_scaling_factor", 1.0)),
                       shared_expert_intermediate_size=inter * int(config_json.get("n_shared_experts") or 0))

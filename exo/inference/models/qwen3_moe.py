"""Qwen3-MoE (30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k norms), and a mixture of experts in every
`decoder_sparse_step`-th layer not in `mlp_only_layers` (the others keep a dense MLP); the picked experts' weights
renormalised only when `norm_topk_prob` says so."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  n_experts = int(config_json.get("num_experts") or config_json.get("num_local_experts") or 0)
  step, dense_only = int(config_json.get("decoder_sparse_step") or 1), set(config_json.get("mlp_only_layers") or [])
  moe_layers = tuple(i for i in range(config_json["num_hidden_layers"]) if n_experts > 0 and i not in dense_only and (i + 1) % step == 0)
  bias = bool(config_json.get("attention_bias", False))
  return dense_decoder(config_json, qk_norm="head", qkv_bias=bias, o_bias=bias, n_experts=n_experts,
                       experts_per_token=int(config_json["num_experts_per_tok"]), expert_intermediate_size=int(config_json["moe_intermediate_size"]),
                       normalize_expert_weights=bool(config_json.get("norm_topk_prob", False)), moe_layers=moe_layers)

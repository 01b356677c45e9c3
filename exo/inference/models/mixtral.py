"""Mixtral: Llama's attention, and in every layer a mixture of experts (8 in 8x7B, 2 picked per token, their weights
renormalised), each expert a SwiGLU MLP stored as w1 (gate), w3 (up) and w2 (down)."""
from exo.inference.models.config import ModelConfig, dense_decoder


def config(config_json: dict) -> ModelConfig:
  return dense_decoder(config_json, n_experts=int(config_json["num_local_experts"]), experts_per_token=int(config_json["num_experts_per_tok"]),
                       expert_intermediate_size=int(config_json["intermediate_size"]), normalize_expert_weights=True,
                       moe_layers=tuple(range(config_json["num_hidden_layers"])), expert_names=("block_sparse_moe", "w1", "w3", "w2"))

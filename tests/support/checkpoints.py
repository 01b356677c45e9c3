"""Checkpoints written by the tests: a small random-weight Llama in Hugging Face form, with the embedded SmolLM2's
tokenizer, under the repo name of a model card in $EXO_HOME/downloads (so the node finds it as downloaded)."""
import json
from pathlib import Path

import numpy as np

from exo.download.shard_download import embedded_model_path, repo_dir
from exo.inference.tokenizers import tokenizer_from_gguf
from exo.models import get_repo, model_cards

SMOLLM2_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def write_random_llama(path: Path, n_layers: int, hidden: int = 64, seed: int = 0) -> Path:
  """config.json, model.safetensors, tokenizer.json and tokenizer_config.json for a Llama with random weights."""
  from safetensors.numpy import save_file
  path.mkdir(parents=True, exist_ok=True)
  tokenizer = tokenizer_from_gguf(embedded_model_path(SMOLLM2_REPO))
  vocab, heads, kv_heads, head_dim, ffn = tokenizer.backend.get_vocab_size(), 4, 2, hidden // 4, 2 * hidden
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "intermediate_size": ffn,
            "num_hidden_layers": n_layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "max_position_embeddings": 2048}
  rng = np.random.default_rng(seed)

  def weight(*shape):
    return (rng.standard_normal(shape) * 0.05).astype(np.float32)
  tensors = {"model.embed_tokens.weight": weight(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
  for i in range(n_layers):
    p = f"model.layers.{i}."
    tensors.update({p + "input_layernorm.weight": np.ones(hidden, np.float32), p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                    p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden), p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
                    p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden), p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
                    p + "mlp.gate_proj.weight": weight(ffn, hidden), p + "mlp.up_proj.weight": weight(ffn, hidden), p + "mlp.down_proj.weight": weight(hidden, ffn)})
  save_file(tensors, str(path / "model.safetensors"))
  (path / "config.json").write_text(json.dumps(config))
  tokenizer.backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tokenizer.chat_template, "eos_token": tokenizer.eos_token,
                                                          "bos_token": tokenizer.bos_token}))
  return path


def install_random_model(model_id: str, engine_classname: str = "NumpyDynamicShardInferenceEngine") -> Path:
  """Write a random-weight stand-in for a model card into $EXO_HOME/downloads, where the node looks first."""
  return write_random_llama(repo_dir(get_repo(model_id, engine_classname)), model_cards[model_id]["layers"])

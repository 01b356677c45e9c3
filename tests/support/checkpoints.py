"""Checkpoints built from the embedded SmolLM2 on disk: a Hugging Face directory, and mlx-lm's own conversions of it
(the format mlx-community publishes). The network reaches no model hub, so tests make what users download."""
import json
from contextlib import contextmanager
from pathlib import Path

from safetensors.numpy import save_file

from exo.inference.weights import LlamaConfig


def write_hf_dir(path: Path, config: LlamaConfig, weights, tokenizer, split: bool = True) -> Path:
  """A Hugging Face style model directory holding the same model (split: over two files with an index)."""
  path.mkdir(exist_ok=True)
  (path / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.hidden_size,
    "intermediate_size": config.intermediate_size, "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
    "num_key_value_heads": config.n_kv_heads, "vocab_size": config.vocab_size, "rms_norm_eps": config.rms_norm_eps,
    "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_word_embeddings,
    "max_position_embeddings": config.max_position_embeddings, "torch_dtype": "float32"}))
  if split:
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
      save_file({n: weights[n] for n in part}, str(path / file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: f for f, part in halves.items() for n in part}}))
  else:
    save_file(weights, str(path / "model.safetensors"))
  tokenizer.backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": tokenizer.chat_template, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}))
  return path


def mixed_precision(path: str, module) -> object:
  """A quantization recipe with per-layer overrides, as mlx-lm's mixed recipes make: v_proj at 8 bits in groups of
  32, layer 0's down_proj left in float, everything else at the default."""
  if path.endswith("v_proj"):
    return {"group_size": 32, "bits": 8}
  return not path.endswith("layers.0.mlp.down_proj")


def mlx_convert(hf_dir: Path, out: Path, **options) -> Path:
  from mlx_lm import convert
  convert(str(hf_dir), mlx_path=str(out), quantize=True, **options)
  return out


@contextmanager
def served_checkpoints():
  """Local checkpoints a test serves (exo.local_checkpoints.serve) leave the process-wide registry, and the allowed
  paths, as they were before it."""
  from exo import local_checkpoints, models
  cards, names = dict(models.model_cards), dict(models.pretty_name)
  named, dirs = set(local_checkpoints._named), list(local_checkpoints._dirs)
  try:
    yield local_checkpoints
  finally:
    for registry, saved in ((models.model_cards, cards), (models.pretty_name, names)):
      registry.clear()
      registry.update(saved)
    local_checkpoints._named.clear()
    local_checkpoints._named.update(named)
    local_checkpoints._dirs[:] = dirs

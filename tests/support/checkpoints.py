"""Checkpoints built on disk: the embedded SmolLM2 as a Hugging Face directory, mlx-lm's own conversions of it (the
format mlx-community publishes), and small random-weight stand-ins for other model cards. The network reaches no model
hub, so tests make what users download."""
import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import numpy as np
from safetensors.numpy import save_file

from exo.download.shard_download import embedded_model_path, repo_dir
from exo.inference.tokenizers import tokenizer_from_gguf
from exo.inference.weights import LlamaConfig
from exo.models import get_repo, model_cards

SMOLLM2_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def write_hf_dir(path: Path, config: LlamaConfig, weights, tokenizer, split: bool = True, file_of: Optional[Callable[[str], str]] = None,
                 model_type: str = "llama", chat_template: Optional[str] = None) -> Path:
  """A Hugging Face style model directory holding the same model (split: over two files with an index; file_of: in
  the file it names for each tensor, with an index); `chat_template` in place of SmolLM2's."""
  path.mkdir(exist_ok=True)
  architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[model_type]
  (path / "config.json").write_text(json.dumps({
    "architectures": [architecture], "model_type": model_type, "hidden_size": config.hidden_size,
    "intermediate_size": config.intermediate_size, "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
    "num_key_value_heads": config.n_kv_heads, "vocab_size": config.vocab_size, "rms_norm_eps": config.rms_norm_eps,
    "rope_theta": config.rope_theta, "tie_word_embeddings": config.tie_word_embeddings,
    "max_position_embeddings": config.max_position_embeddings, "torch_dtype": "float32"}))
  if split and file_of is None:
    halves = {n: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, n in enumerate(sorted(weights))}
    file_of = halves.__getitem__
  if file_of is None:
    save_file(weights, str(path / "model.safetensors"))
  else:
    weight_map = {n: file_of(n) for n in weights}
    for file in sorted(set(weight_map.values())):
      save_file({n: w for n, w in weights.items() if weight_map[n] == file}, str(path / file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return write_tokenizer(path, tokenizer, chat_template)


def write_tokenizer(path: Path, tokenizer, chat_template: Optional[str] = None) -> Path:
  """SmolLM2's tokenizer and chat template (or `chat_template`), as a Hugging Face directory holds them."""
  tokenizer.backend.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template or tokenizer.chat_template, "eos_token": "<|im_end|>",
                                                          "bos_token": "<|im_start|>"}))
  return path


def random_qwen2(n_layers: int, hidden: int = 64):
  """random_llama's model with Qwen2's biases on q, k and v."""
  config, weights, tokenizer = random_llama(n_layers, hidden)
  rng = np.random.default_rng(1)
  for i in range(n_layers):
    for part, rows in (("q", config.n_heads * config.head_dim), ("k", config.n_kv_heads * config.head_dim), ("v", config.n_kv_heads * config.head_dim)):
      weights[f"model.layers.{i}.self_attn.{part}_proj.bias"] = (rng.standard_normal(rows) * 0.05).astype(np.float32)
  return config, weights, tokenizer


FIXTURE_MODELS = Path(__file__).parent.parent / "fixtures" / "models"


# A chat template that adds nothing to the messages' text: the fixtures know only SmolLM2's first 512 tokens, which
# SmolLM2's own template's system prompt goes beyond.
PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def fixture_checkpoint(name: str, dest: Path, chat_template: Optional[str] = None) -> Path:
  """The small checkpoint tests/fixtures/make_models.py made for `name`, copied to `dest` with SmolLM2's tokenizer
  (the checkpoints' 512 token ids are its first 512 tokens)."""
  shutil.copytree(FIXTURE_MODELS / name, dest)
  return write_tokenizer(dest, tokenizer_from_gguf(embedded_model_path(SMOLLM2_REPO)), chat_template)


def renamed_tokens(path: Path, names: Dict[str, Tuple[str, bool]]) -> Path:
  """The tokenizer in `path` with some of SmolLM2's unused special tokens renamed ({old: (new, special)}), so that a
  checkpoint has a model family's markers as tokens of their own, at ids below 512 (the fixtures' vocabulary)."""
  file = path / "tokenizer.json"
  data = json.loads(file.read_text())
  for token in data["added_tokens"]:
    if token["content"] in names:
      token["content"], token["special"] = names[token["content"]]
  data["model"]["vocab"] = {names[k][0] if k in names else k: v for k, v in data["model"]["vocab"].items()}
  file.write_text(json.dumps(data))
  return path


def with_think_tokens(path: Path) -> Path:
  """`<think>` and `</think>` as tokens of their own, as Qwen3's tokenizer has them (added, not special: they read as
  text), in the places of ids 3 and 4."""
  return renamed_tokens(path, {"<repo_name>": ("<think>", False), "<reponame>": ("</think>", False)})


def with_mistral_tokens(path: Path) -> Path:
  """`[TOOL_CALLS]` and `[ARGS]` as control tokens, as Mistral's tokenizers have them, in the places of ids 5 and 6."""
  return renamed_tokens(path, {"<file_sep>": ("[TOOL_CALLS]", True), "<filename>": ("[ARGS]", True)})


def gpt_oss_in_mlx_lms_layout(source: Path, dest: Path, **config_fields) -> Path:
  """A gpt-oss checkpoint as transformers writes it (experts stacked (in, out), gate and up interleaved) rewritten as
  mlx-lm keeps one: each projection of every expert stacked (experts, out, in), the config in transformers 4's form
  with `config_fields` over it."""
  from exo.inference.weights import _read_safetensors, _safetensors_header
  file = source / "model.safetensors"
  weights = _read_safetensors(file, [n for n in _safetensors_header(file)[0] if n != "__metadata__"])
  out = {}
  for name, w in weights.items():
    if name.endswith("experts.gate_up_proj"):
      out[name.replace("gate_up_proj", "gate_proj.weight")], out[name.replace("gate_up_proj", "up_proj.weight")] = w[..., 0::2].swapaxes(1, 2), w[..., 1::2].swapaxes(1, 2)
    elif name.endswith("experts.gate_up_proj_bias"):
      out[name.replace("gate_up_proj_bias", "gate_proj.bias")], out[name.replace("gate_up_proj_bias", "up_proj.bias")] = w[..., 0::2], w[..., 1::2]
    elif name.endswith("experts.down_proj"):
      out[name + ".weight"] = w.swapaxes(1, 2)
    elif name.endswith("experts.down_proj_bias"):
      out[name.replace("down_proj_bias", "down_proj.bias")] = w
    else:
      out[name] = w
  dest.mkdir(parents=True)
  save_file({name: np.ascontiguousarray(w) for name, w in out.items()}, str(dest / "model.safetensors"))
  (dest / "config.json").write_text(json.dumps({**transformers4_form(json.loads((source / "config.json").read_text())), **config_fields}))
  return dest


def mlx_lm_readable_checkpoint(name: str, dest: Path) -> Path:
  """The fixture `name` (with SmolLM2's tokenizer) in a form mlx-lm reads as transformers does: gpt-oss in mlx-lm's
  own layout (gpt_oss_in_mlx_lms_layout, SwiGLU clamped at mlx-lm's fixed 7); Qwen3-MoE with its config in
  transformers 4's form, whose `num_experts` mlx-lm reads; the others as they are."""
  if name == "gpt_oss":
    gpt_oss_in_mlx_lms_layout(FIXTURE_MODELS / "gpt_oss", dest, swiglu_limit=7.0)
    return write_tokenizer(dest, tokenizer_from_gguf(embedded_model_path(SMOLLM2_REPO)))
  path = fixture_checkpoint(name, dest)
  if name == "qwen3_moe":
    config = transformers4_form(json.loads((path / "config.json").read_text()))
    config["num_experts"] = config.pop("num_local_experts")
    (path / "config.json").write_text(json.dumps(config))
  return path


def transformers4_form(config: dict) -> dict:
  """config.json as transformers 4 wrote it: `rope_theta` and `rope_scaling` in place of `rope_parameters`."""
  config = json.loads(json.dumps(config))  # a copy, nested dicts included
  params = dict(config.pop("rope_parameters", None) or {})
  if "full_attention" in params:  # Gemma 3: the full layers' RoPE, the sliding layers' base, and how often a layer is full
    sliding = params.pop("sliding_attention")
    params = params["full_attention"]
    config["rope_local_base_freq"] = sliding["rope_theta"]
    config["sliding_window_pattern"] = config["layer_types"].index("full_attention") + 1
    config.pop("_sliding_window_pattern", None)
  config["rope_theta"] = params.pop("rope_theta", 10000.0)
  config["rope_scaling"] = None if params.get("rope_type", "default") == "default" else params
  config.pop("layer_types", None)
  return config


def random_llama(n_layers: int, hidden: int = 64):
  """A Llama with random weights, `n_layers` layers and SmolLM2's tokenizer: (config, weights, tokenizer)."""
  tokenizer = tokenizer_from_gguf(embedded_model_path(SMOLLM2_REPO))
  config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                       vocab_size=tokenizer.backend.get_vocab_size(), head_dim=hidden // 4, tie_word_embeddings=True, max_position_embeddings=2048)
  rng = np.random.default_rng(0)

  def weight(*shape):
    return (rng.standard_normal(shape) * 0.05).astype(np.float32)
  q, kv, ffn = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim, config.intermediate_size
  weights = {"model.embed_tokens.weight": weight(config.vocab_size, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
  for i in range(config.n_layers):
    p = f"model.layers.{i}."
    weights.update({p + "input_layernorm.weight": np.ones(hidden, np.float32), p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
                    p + "self_attn.q_proj.weight": weight(q, hidden), p + "self_attn.k_proj.weight": weight(kv, hidden),
                    p + "self_attn.v_proj.weight": weight(kv, hidden), p + "self_attn.o_proj.weight": weight(hidden, q),
                    p + "mlp.gate_proj.weight": weight(ffn, hidden), p + "mlp.up_proj.weight": weight(ffn, hidden), p + "mlp.down_proj.weight": weight(hidden, ffn)})
  return config, weights, tokenizer


def install_random_model(model_id: str, engine_classname: str = "NumpyDynamicShardInferenceEngine", hidden: int = 64) -> Path:
  """A random-weight Llama with the card's layer count, written into $EXO_HOME/downloads under the card's repo name,
  where the node finds it as downloaded."""
  config, weights, tokenizer = random_llama(model_cards[model_id]["layers"], hidden)
  path = repo_dir(get_repo(model_id, engine_classname))
  path.mkdir(parents=True, exist_ok=True)
  return write_hf_dir(path, config, weights, tokenizer, split=False)


def write_layer_split_llama(path: Path, n_layers: int, halves: int = 2, hidden: int = 64) -> Path:
  """A random-weight Llama as a hub repository holds a large one: its layers in `halves` weight files by layer range,
  embeddings and final norm in a file of their own, and an index naming the file of every tensor. A ring node that
  holds some of the layers needs only their files and the last one."""
  config, weights, tokenizer = random_llama(n_layers, hidden)
  per_file = -(-n_layers // halves)
  files = [f"model-{i + 1:05d}-of-{halves + 1:05d}.safetensors" for i in range(halves + 1)]

  def file_of(name: str) -> str:
    layer = next((int(p) for p in name.split(".") if p.isdigit()), None)
    return files[-1] if layer is None else files[layer // per_file]
  return write_hf_dir(path, config, weights, tokenizer, file_of=file_of)


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
  ollama_names, refused = dict(local_checkpoints._ollama_names), dict(local_checkpoints._refused)
  try:
    yield local_checkpoints
  finally:
    for registry, saved in ((models.model_cards, cards), (models.pretty_name, names), (local_checkpoints._ollama_names, ollama_names),
                            (local_checkpoints._refused, refused)):
      registry.clear()
      registry.update(saved)
    local_checkpoints._named.clear()
    local_checkpoints._named.update(named)
    local_checkpoints._dirs[:] = dirs


HARMONY_TOKENS = {"<repo_name>": "<|start|>", "<reponame>": "<|channel|>", "<file_sep>": "<|message|>", "<filename>": "<|end|>",
                  "<gh_stars>": "<|return|>", "<issue_start>": "<|call|>", "<issue_comment>": "<|constrain|>"}
HARMONY_TEMPLATE = (FIXTURE_MODELS.parent / "harmony_chat_template.jinja").read_text()


def gpt_oss_with_harmony(dest: Path) -> Path:
  """The gpt-oss fixture (tests/fixtures/models/gpt_oss) as a gpt-oss checkpoint talks: harmony's markers as special
  tokens of their own (ids 3 to 9 of SmolLM2's tokenizer), its replies ending at `<|return|>` or `<|call|>`, and a
  harmony chat template (tests/fixtures/harmony_chat_template.jinja, written for these tests: gpt-oss's own is not
  available offline). Its embeddings and head are widened with random rows to SmolLM2's whole vocabulary, so that
  any text (role names, JSON) tokenises to ids the model has."""
  from exo.inference.weights import _read_safetensors, _safetensors_header
  source = FIXTURE_MODELS / "gpt_oss"
  file = source / "model.safetensors"
  weights = _read_safetensors(file, [n for n in _safetensors_header(file)[0] if n != "__metadata__"])
  tokenizer = tokenizer_from_gguf(embedded_model_path(SMOLLM2_REPO))
  vocab = tokenizer.backend.get_vocab_size()
  rng = np.random.default_rng(2)
  for name in ("model.embed_tokens.weight", "lm_head.weight"):
    w = weights[name]
    weights[name] = np.concatenate([w, (rng.standard_normal((vocab - w.shape[0], w.shape[1])) * w.std()).astype(np.float32)])
  dest.mkdir(parents=True)
  save_file(weights, str(dest / "model.safetensors"))
  (dest / "config.json").write_text(json.dumps({**json.loads((source / "config.json").read_text()), "vocab_size": vocab, "dtype": "float32"}))
  write_tokenizer(dest, tokenizer, HARMONY_TEMPLATE)
  renamed_tokens(dest, {old: (new, True) for old, new in HARMONY_TOKENS.items()})
  ids = {new: tokenizer.backend.token_to_id(old) for old, new in HARMONY_TOKENS.items()}
  (dest / "tokenizer_config.json").write_text(json.dumps({"chat_template": HARMONY_TEMPLATE, "eos_token": "<|return|>"}))
  (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|return|>"], ids["<|call|>"]]}))
  return dest

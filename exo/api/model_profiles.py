"""What the API knows of a model before anything runs: its tokenizer and its limits (exo/api/model_limits.py), read
once per model from its files (the embedded model, a local checkpoint, or this node's shard of a download, which ends at
once when it is complete on disk and raises DownloadError when it fails),
never by loading the engine, which would wipe the KV caches of the requests it serves."""
import asyncio
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

from exo.api.errors import BadRequest
from exo.api.model_limits import ModelLimits
from exo.download.shard_download import local_model_path
from exo.inference.tokenizers import resolve_tokenizer
from exo.inference.models import ModelConfig, UnsupportedModel
from exo.inference.models.config import check_engine
from exo.inference.weights import load_config
from exo.models import build_base_shard, get_repo


def local_files(repo: Optional[str]) -> Union[Path, str, None]:
  """Where a model's tokenizer and config are on this machine without a download: "dummy" for the dummy model, the
  embedded model or a local checkpoint, or None (a folder under $EXO_HOME/downloads counts only once its download
  is complete, which the downloader knows)."""
  if repo is None:
    return None
  if repo == "dummy":
    return "dummy"
  return local_model_path(repo)


def model_config_of(model_id: str, local: Path, engine_classname: str) -> ModelConfig:
  """The model's configuration; a model whose config asks for what this node's engine does not compute is the
  request's mistake in choosing it: a 400 naming the config field."""
  try:
    config = load_config(local)
    check_engine(config, engine_classname)
    return config
  except UnsupportedModel as e:
    raise BadRequest(f"model {model_id!r} cannot run here: its config.json {e}", param="model", code="model_not_supported") from None


class ModelProfiles:
  def __init__(self, node, engine_classname: str):
    self.node, self.engine_classname = node, engine_classname
    self._profiles: Dict[str, Tuple[object, ModelLimits]] = {}
    self._locks: Dict[str, asyncio.Lock] = {}

  async def get(self, model_id: str) -> Tuple[object, ModelLimits]:
    """The model's (tokenizer, limits)."""
    if model_id in self._profiles:
      return self._profiles[model_id]
    async with self._locks.setdefault(model_id, asyncio.Lock()):
      if model_id not in self._profiles:
        local = local_files(get_repo(model_id, self.engine_classname))
        if local == "dummy":
          profile = (resolve_tokenizer("dummy"), ModelLimits())
        else:
          if local is None:  # this node's shard of its files, downloaded
            base = build_base_shard(model_id, self.engine_classname)
            local = await self.node.shard_downloader.ensure_shard(self.node.own_shard(base), self.engine_classname)
          config = await asyncio.to_thread(model_config_of, model_id, local, self.engine_classname)  # first: a refused model needs no tokenizer
          engine = self.node.inference_engine
          limits = ModelLimits.of(config, engine.kv_bytes_per_value(config), engine.kv_keeps_window)
          profile = (await asyncio.to_thread(resolve_tokenizer, local), limits)
        self._profiles[model_id] = profile
    return self._profiles[model_id]

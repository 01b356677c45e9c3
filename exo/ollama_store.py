"""Ollama's model store read as it lies: which models it holds, under Ollama's names, and the GGUF blob of each.

A store is a directory with `manifests/<registry>/<namespace>/<model>/<tag>` (one JSON manifest a model, Docker's
distribution format: `layers`, each with a `mediaType` and a `digest`) and `blobs/sha256-<hex>` (each layer's bytes,
named by digest). The layer of media type `application/vnd.ollama.image.model` is the GGUF, which holds the weights,
the tokenizer and the chat template; the `params` layer is a JSON object of defaults, whose `stop` strings are kept.
Nothing is copied or written: the blobs are read in place.

Names are Ollama's: `model:tag` in the `library` namespace, `namespace/model:tag` in any other. The registry (the
manifests' first level) is left out of the names of one registry: the one holding the `library` namespace, or the
only one there is; the others' models are named `registry/namespace/model:tag`. That full form also names every
model. A manifest that cannot be read, names no GGUF, or whose blob is missing is skipped with a warning, never
fatal: a half-pulled model must not stop a node."""
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from exo.inference.gguf_header import is_gguf

log = logging.getLogger(__name__)

MODEL_LAYER = "application/vnd.ollama.image.model"
PARAMS_LAYER = "application/vnd.ollama.image.params"
LIBRARY = "library"  # Ollama's namespace for its own library's models, left out of their names
LATEST = "latest"  # the tag a name without one means


@dataclass(frozen=True)
class OllamaModel:
  name: str  # as Ollama names it: llama3.2:1b, someone/model:tag
  full_name: str  # registry/namespace/model:tag
  gguf: Path  # the model layer's blob
  manifest: Path
  stop: Tuple[str, ...] = ()  # the params layer's stop strings


@dataclass
class StoreContents:
  models: List[OllamaModel] = field(default_factory=list)
  skipped: Dict[str, str] = field(default_factory=dict)  # manifest path -> why it was skipped


def is_store(path: Path) -> bool:
  return (path / "manifests").is_dir() and (path / "blobs").is_dir()


def chosen_store(given: Optional[str], source: str) -> Optional[Path]:
  """The store to serve: the one given (`off`: none), else Ollama's default, ~/.ollama/models, where it is one.
  ValueError for a given directory that is not a store (`source` names the flag or variable it came by)."""
  if given is not None and given.strip().lower() == "off":
    return None
  if given is None or not given.strip():
    home = Path.home() / ".ollama" / "models"
    return home if is_store(home) else None
  path = Path(given.strip()).expanduser()
  if not is_store(path):
    raise ValueError(f"{source} {given}: not an Ollama model store (expected a directory with manifests/ and blobs/)")
  return path


def blob_path(store: Path, digest: str) -> Path:
  """Where a layer's bytes lie: the digest `sha256:<hex>` as the file name `sha256-<hex>`."""
  algorithm, _, hex_digest = digest.partition(":")
  if not algorithm.isalnum() or not hex_digest.isalnum():  # a digest is never a path: refuse `../`
    raise ValueError(f"digest {digest!r} is not of the form sha256:<hex>")
  return store / "blobs" / f"{algorithm}-{hex_digest}"


def _manifests(store: Path) -> List[Tuple[str, str, str, str, Path]]:
  """(registry, namespace, model, tag, file) of every manifest, in a stable order."""
  root = store / "manifests"
  found = []
  for file in sorted(root.glob("*/*/*/*")):
    if file.is_file() and not file.name.startswith("."):
      registry, namespace, model, tag = file.relative_to(root).parts
      found.append((registry, namespace, model, tag, file))
  return found


def _short_registry(manifests) -> Optional[str]:
  registries = sorted({m[0] for m in manifests})
  with_library = [r for r in registries if any(m[0] == r and m[1] == LIBRARY for m in manifests)]
  return with_library[0] if with_library else registries[0] if len(registries) == 1 else None


def _layers(manifest: Path) -> Dict[str, str]:
  """media type -> digest of the manifest's layers."""
  data = json.loads(manifest.read_text())
  layers = data.get("layers") if isinstance(data, dict) else None
  if not isinstance(layers, list):
    raise ValueError("no `layers` list")
  return {layer["mediaType"]: layer["digest"] for layer in layers
          if isinstance(layer, dict) and isinstance(layer.get("mediaType"), str) and isinstance(layer.get("digest"), str)}


def _stop_strings(store: Path, digest: Optional[str]) -> Tuple[str, ...]:
  if digest is None:
    return ()
  params = json.loads(blob_path(store, digest).read_text())
  stop = params.get("stop") if isinstance(params, dict) else None
  stop = [stop] if isinstance(stop, str) else stop
  return tuple(s for s in stop if isinstance(s, str) and s) if isinstance(stop, list) else ()


def _read_model(store: Path, name: str, full_name: str, manifest: Path) -> OllamaModel:
  layers = _layers(manifest)
  if MODEL_LAYER not in layers:
    raise ValueError(f"no layer of media type {MODEL_LAYER} (the GGUF)")
  gguf = blob_path(store, layers[MODEL_LAYER])
  if not gguf.is_file():
    raise ValueError(f"its model blob {gguf.name} is missing (a pull that did not finish?)")
  if not os.access(gguf, os.R_OK):
    raise ValueError(f"its model blob {gguf.name} is not readable by this user")
  if not is_gguf(gguf):
    raise ValueError(f"its model blob {gguf.name} is not a GGUF file")
  try:
    stop = _stop_strings(store, layers.get(PARAMS_LAYER))
  except (OSError, ValueError) as e:
    log.warning(f"Ollama model {name}: its params layer is unreadable ({e}); served without its stop strings")
    stop = ()
  return OllamaModel(name, full_name, gguf, manifest, stop)


def read_store(store: Path) -> StoreContents:
  """Every model the store's manifests name whose GGUF blob is there; the rest in `skipped`, each logged."""
  contents = StoreContents()
  manifests = _manifests(store)
  short = _short_registry(manifests)
  for registry, namespace, model, tag, file in manifests:
    full_name = f"{registry}/{namespace}/{model}:{tag}"
    name = f"{model}:{tag}" if namespace == LIBRARY else f"{namespace}/{model}:{tag}"
    if registry != short:
      name = full_name
    try:
      contents.models.append(_read_model(store, name, full_name, file))
    except (OSError, ValueError, KeyError, TypeError) as e:
      contents.skipped[str(file)] = str(e)
      log.warning(f"Ollama model {name} ({file}) skipped: {e}")
  return contents


def tagged(name: str) -> str:
  """A name with its tag: `llama3.2` is `llama3.2:latest`."""
  return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:{LATEST}"

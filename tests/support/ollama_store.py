"""Ollama-style model stores built on disk, as `ollama pull` leaves them: manifests naming layers by digest, and the
layers' bytes in blobs/sha256-<hex>. The registry is a made-up name: the code reads it as an opaque directory."""
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

REGISTRY = "registry.example"
MODEL = "application/vnd.ollama.image.model"
PARAMS = "application/vnd.ollama.image.params"


@lru_cache(maxsize=16)
def sha256_of(path: Path) -> str:
  """(Cached: the tests link the same 98 MB GGUF into many stores.)"""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def add_blob(store: Path, source: Optional[Path] = None, data: Optional[bytes] = None) -> str:
  """A blob named by its digest: a symlink to `source` (never a copy of a big file), or `data` written; its digest."""
  (store / "blobs").mkdir(parents=True, exist_ok=True)
  hex_digest = sha256_of(source) if source is not None else hashlib.sha256(data).hexdigest()
  blob = store / "blobs" / f"sha256-{hex_digest}"
  if blob.exists():
    return f"sha256:{hex_digest}"
  if source is not None:
    os.symlink(source, blob)
  else:
    blob.write_bytes(data)
  return f"sha256:{hex_digest}"


def add_manifest(store: Path, namespace: str, model: str, tag: str, layers: list, registry: str = REGISTRY) -> Path:
  """A manifest as Ollama writes one (Docker's distribution format), naming `layers` [(media type, digest)]."""
  path = store / "manifests" / registry / namespace / model / tag
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
                              "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:" + "0" * 64, "size": 2},
                              "layers": [{"mediaType": kind, "digest": digest, "size": 1} for kind, digest in layers]}))
  return path


def add_gguf_model(store: Path, namespace: str, model: str, tag: str, gguf: Path, params: Optional[dict] = None,
                   registry: str = REGISTRY) -> Path:
  """A model whose GGUF is `gguf` (linked, not copied), with a params layer when given."""
  layers = [(MODEL, add_blob(store, gguf))]
  if params is not None:
    layers.append((PARAMS, add_blob(store, data=json.dumps(params).encode())))
  return add_manifest(store, namespace, model, tag, layers, registry)


def write_header_only_gguf(path: Path, architecture: str, layers: int = 2) -> Path:
  """A GGUF of metadata alone (no tensors), claiming `architecture`."""
  import gguf
  writer = gguf.GGUFWriter(str(path), architecture)
  writer.add_block_count(layers)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path

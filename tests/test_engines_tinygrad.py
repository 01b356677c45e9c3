"""The tinygrad engine on the real SmolLM2-135M (tinygrad's CPU device here; CUDA/METAL take the same code)."""
import numpy as np
import pytest

pytest.importorskip("tinygrad")  # CI installs it; this only spares machines without the package

from exo.download.shard_download import HFShardDownloader  # noqa: E402
from exo.inference.engines import get_inference_engine  # noqa: E402
from exo.inference.tinygrad.engine import TinygradDynamicShardInferenceEngine  # noqa: E402
from tests.support import engines as common  # noqa: E402
from tests.support.models import smollm2_shard  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine(downloader):
  return common.load_engine(TinygradDynamicShardInferenceEngine, downloader)


@pytest.fixture(scope="module")
def engine_class():
  return TinygradDynamicShardInferenceEngine


def test_registry_builds_it():
  engine = get_inference_engine("tinygrad", HFShardDownloader())
  assert isinstance(engine, TinygradDynamicShardInferenceEngine) and engine.device_name in ("CPU", "CLANG", "LLVM", "CUDA", "NV", "METAL", "AMD", "GPU", "CL")


class TestEngineChecks(common.EngineChecks):
  pass


async def test_steady_decode_reuses_one_jit(engine):
  """Decoding the same mix of requests replays captured jits: no new jit per token, whichever requests they are."""
  shard = smollm2_shard()
  ids = common.prompt_ids(engine, ["Say hello.", "Who wrote Hamlet?"])
  for i, x in enumerate(ids):
    await engine.infer_tensor(f"jit-{i}", shard, x.reshape(1, -1))
  tokens = [5, 7]
  for step in range(4):
    if step == 2:
      jits = dict(engine.model.jits)
    results = await engine.infer_batch(shard, [(f"jit-{i}", np.array([[t]]), None) for i, t in enumerate(tokens)])
    tokens = [common.argmax(logits) for logits, _ in results]
  assert dict(engine.model.jits) == jits, "steady decode built new jits"
  layer_jits = engine.model.jits[("layer", (2, (1, 64), (1, 64)))]
  assert all(j.cnt >= 2 for j in layer_jits), "the decode step should be replaying captured jits"
  for i in range(2):
    await engine.finish_request(f"jit-{i}")
  assert engine.kv_cache_bytes() == 0

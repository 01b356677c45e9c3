"""Building an engine by its short name (`--inference-engine`). Each engine is imported only when asked for, so a
node needs only the packages of the engine it runs."""
from exo import settings
from exo.inference.inference_engine import InferenceEngine


def get_inference_engine(inference_engine_name: str, shard_downloader) -> InferenceEngine:
  if inference_engine_name == "numpy":
    from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
    return NumpyDynamicShardInferenceEngine(shard_downloader)
  if inference_engine_name == "mlx":
    from exo.inference.mlx.engine import MLXDynamicShardInferenceEngine
    return MLXDynamicShardInferenceEngine(shard_downloader)
  if inference_engine_name == "tinygrad":
    from exo.inference.tinygrad.engine import TinygradDynamicShardInferenceEngine
    import tinygrad.helpers
    tinygrad.helpers.DEBUG.value = settings.env_int("TINYGRAD_DEBUG")
    return TinygradDynamicShardInferenceEngine(shard_downloader)
  if inference_engine_name == "dummy":
    from exo.inference.dummy_inference_engine import DummyInferenceEngine
    return DummyInferenceEngine()
  raise ValueError(f"Unsupported inference engine: {inference_engine_name}")

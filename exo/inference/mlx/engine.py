from concurrent.futures import ThreadPoolExecutor

from exo.inference.llama_engine import LlamaShardEngine


def _mlx_device() -> str:
  import mlx.core as mx
  return "METAL" if mx.default_device().type == mx.DeviceType.gpu else "CPU"


class MLXDynamicShardInferenceEngine(LlamaShardEngine):
  """Llama in MLX (Metal on Apple silicon, CPU elsewhere), quantized checkpoints kept quantized, on one worker thread."""
  keeps_quantized = True
  kv_keeps_window = True  # cache.py cuts a sliding layer's arrays down to its window

  def __init__(self, shard_downloader):
    super().__init__(shard_downloader, ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-engine"))
    self.device_name: str = self.executor.submit(_mlx_device).result()

  def new_model(self, config, shard, weights):
    from exo.inference.mlx.llama import Llama
    return Llama(config, shard, weights)

  def kv_bytes_per_value(self, config) -> int:
    from exo.inference.mlx.matrix import compute_dtype
    return compute_dtype(config).size  # the model's own precision on a GPU, float32 on the CPU

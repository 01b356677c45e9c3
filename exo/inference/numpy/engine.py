import sys
from concurrent.futures import ThreadPoolExecutor

from exo.inference.llama_engine import LlamaShardEngine
from exo.inference.numpy.cache import kv_dtype
from exo.inference.numpy.kernels import single_threaded_blas
from exo.inference.numpy.llama import Llama

GIL_SWITCH_S = 0.0005


class NumpyDynamicShardInferenceEngine(LlamaShardEngine):
  """Llama in float32 numpy, on one worker thread with single-threaded BLAS (llama.py spreads big steps itself).
  Quantized weights (GGUF Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K, MLX affine 4/8-bit) stay quantized in memory (packed.py)."""
  keeps_quantized = True
  kv_keeps_window = True  # cache.py hands a sliding layer's older pages back

  def __init__(self, shard_downloader):
    super().__init__(shard_downloader, ThreadPoolExecutor(max_workers=1, thread_name_prefix="numpy-engine"))
    single_threaded_blas()
    # The step's threads take the GIL back after every numpy call; while the event loop runs Python (delivering the
    # last step's tokens) each such wait lasts up to the switch interval, 5 ms by default: a node measured 6 ms from
    # a step's hand-over to its first layer, every step.
    sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))

  def new_model(self, config, shard, weights):
    return Llama(config, shard, weights)

  def kv_bytes_per_value(self, config) -> int:
    return kv_dtype().itemsize

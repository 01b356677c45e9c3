from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np

from exo.inference.llama_engine import LlamaShardEngine

_executor: Optional[ThreadPoolExecutor] = None


def tinygrad_thread() -> ThreadPoolExecutor:
  """The one thread that runs tinygrad in this process, shared by every engine: tinygrad keeps process-wide state
  (its scheduler, jits, and a SQLite kernel cache that refuses use from any thread but the one that opened it)."""
  global _executor
  if _executor is None:
    _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinygrad")
  return _executor


def _tinygrad_device() -> str:
  from tinygrad import Device
  return Device.DEFAULT


class TinygradDynamicShardInferenceEngine(LlamaShardEngine):
  """Llama in float32 tinygrad (CPU/CLANG, CUDA, METAL, ... whatever Device.DEFAULT is), on tinygrad's one thread."""

  def __init__(self, shard_downloader):
    super().__init__(shard_downloader, tinygrad_thread())
    self.device_name: str = self.executor.submit(_tinygrad_device).result()

  def new_model(self, config, shard, weights):
    from exo.inference.tinygrad.llama import Llama
    return Llama(config, shard, weights)

  def kv_bytes_per_value(self, config) -> int:
    from exo.inference.tinygrad.llama import float_dtype
    return np.dtype(float_dtype()).itemsize

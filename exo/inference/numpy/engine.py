import asyncio
import ctypes
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from exo.inference.inference_engine import InferenceEngine
from exo.inference.numpy.llama import KVCache, Llama
from exo.inference.sampling import sample_last
from exo.inference.shard import Shard
from exo.inference.tokenizers import resolve_tokenizer
from exo.inference.weights import load_shard_weights


def single_threaded_blas() -> None:
  """Run this process's OpenBLAS on one thread, unless OPENBLAS_NUM_THREADS says otherwise.

  The model's products are small on purpose (see llama.py); OpenBLAS would hand some of them to helper threads
  that spin-wait, and on a machine shared with other processes that made steps several times slower."""
  if os.environ.get("OPENBLAS_NUM_THREADS"):
    return
  try:
    libraries = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", Path("/proc/self/maps").read_text())))
  except OSError:  # not Linux: Accelerate or MKL, nothing to do
    return
  for path in libraries:
    library = ctypes.CDLL(path)
    for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
      setter = getattr(library, name, None)
      if setter is not None:
        setter.argtypes = [ctypes.c_int]
        setter(1)
        break


class NumpyDynamicShardInferenceEngine(InferenceEngine):
  """Llama in float32 numpy. All model work runs on one worker thread, in order, with single-threaded BLAS."""

  def __init__(self, shard_downloader):
    self.shard_downloader = shard_downloader
    self.shard: Optional[Shard] = None
    self.model: Optional[Llama] = None
    self.tokenizer = None
    self.caches: Dict[str, KVCache] = {}
    self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="numpy-engine")
    single_threaded_blas()
    self._load_lock = asyncio.Lock()

  async def _run(self, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

  async def ensure_shard(self, shard: Shard) -> None:
    if self.shard == shard:
      return
    async with self._load_lock:
      if self.shard == shard:
        return
      path = await self.shard_downloader.ensure_shard(shard, self.__class__.__name__)
      config, weights = await self._run(load_shard_weights, path, shard)
      model = Llama(config, shard, weights)
      tokenizer = await self._run(resolve_tokenizer, path)
      self.model, self.tokenizer, self.caches, self.shard = model, tokenizer, {}, shard

  async def encode(self, shard: Shard, prompt: str) -> np.ndarray:
    await self.ensure_shard(shard)
    return np.array(self.tokenizer.encode(prompt), dtype=np.int64)

  async def decode(self, shard: Shard, tokens: np.ndarray) -> str:
    await self.ensure_shard(shard)
    return self.tokenizer.decode(tokens)

  async def sample(self, x: np.ndarray, temp: float = 0.0, top_p: float = 1.0) -> np.ndarray:
    return sample_last(x, temp, top_p)

  async def infer_tensor(self, request_id: str, shard: Shard, input_data: np.ndarray, inference_state: Optional[dict] = None) -> Tuple[np.ndarray, Optional[dict]]:
    result = (await self.infer_batch(shard, [(request_id, input_data, inference_state)]))[0]
    if isinstance(result, Exception):
      raise result
    return result

  async def infer_batch(self, shard: Shard, items: List[Tuple[str, np.ndarray, Optional[dict]]]) -> List[Tuple[np.ndarray, Optional[dict]]]:
    await self.ensure_shard(shard)
    return await self._run(self._step, items)

  def _step(self, items):
    model = self.model
    results: List = [None] * len(items)
    inputs, caches, rows = [], [], []
    for i, (request_id, x, state) in enumerate(items):
      x = np.asarray(x)
      try:
        inputs.append(self._check_input(x))
      except ValueError as e:
        results[i] = e
        continue
      if request_id not in self.caches:
        self.caches[request_id] = model.new_cache()
      caches.append(self.caches[request_id])
      rows.append(i)
    if rows:
      for i, out in zip(rows, model.forward(inputs, caches)):
        results[i] = (out[None], items[i][2])
    return results

  def _check_input(self, x: np.ndarray) -> np.ndarray:
    """One request's input as the model takes it; a clear error instead of a broken cache."""
    c = self.model.config
    if self.shard.is_first_layer():
      if not np.issubdtype(x.dtype, np.integer) or x.size == 0:
        raise ValueError(f"first shard expects token ids, got {x.dtype} {x.shape}")
      ids = x.reshape(-1)
      if ids.min() < 0 or ids.max() >= c.vocab_size:
        raise ValueError(f"token id out of range [0, {c.vocab_size})")
      return ids
    if x.ndim != 3 or x.shape[0] != 1 or x.shape[2] != c.hidden_size or x.shape[1] == 0:
      raise ValueError(f"expected hidden states (1, L, {c.hidden_size}), got {x.shape}")
    return x[0].astype(np.float32, copy=False)

  async def finish_request(self, request_id: str) -> None:
    await self._run(self.caches.pop, request_id, None)

  def kv_cache_bytes(self) -> int:
    return sum(cache.nbytes for cache in self.caches.values())

  async def load_checkpoint(self, shard: Shard, path: str):
    await self.ensure_shard(shard)

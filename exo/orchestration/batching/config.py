"""Batching settings (EXO_BATCH_SIZE, EXO_BATCH_TIMEOUT_MS, EXO_PREFILL_CHUNK and their flags: exo/settings.py). On
with a size of 2 or more; a timeout or chunk without a size is refused, so a typo never silently leaves it off."""
from dataclasses import dataclass
from typing import Mapping, Optional

from exo import settings

DEFAULT_TIMEOUT_MS = 5.0  # only paid while other requests of this node are about to join; a lone request pays nothing
DEFAULT_PREFILL_CHUNK = 24  # bench: a 512-token prompt among 7 decoding streams stalls them at most ~2.5x their median gap (32: ~3x)
MAX_BATCH_SIZE = 4096
MAX_TIMEOUT_MS = 60_000.0
MAX_PREFILL_CHUNK = 1 << 20


@dataclass(frozen=True)
class BatchingConfig:
  batch_size: int
  timeout_ms: float = DEFAULT_TIMEOUT_MS
  prefill_chunk: int = DEFAULT_PREFILL_CHUNK

  def describe(self) -> str:
    chunk = f"prompts in chunks of {self.prefill_chunk} tokens" if self.prefill_chunk else "whole prompts"
    return f"batching on: up to {self.batch_size} requests per step, wait up to {self.timeout_ms:g} ms after the latest arrival for others, {chunk}"


def batching_config_from(args, environ: Mapping[str, str]) -> Optional[BatchingConfig]:
  """The batching settings for this node, or None when batching is off. Raises ValueError (one line) on bad values."""
  size, _ = settings.number(args, environ, "batch_size", 1, MAX_BATCH_SIZE, f"an integer from 1 to {MAX_BATCH_SIZE}")
  timeout, timeout_name = settings.number(args, environ, "batch_timeout_ms", 0, MAX_TIMEOUT_MS, f"a number of milliseconds from 0 to {MAX_TIMEOUT_MS:g}",
                                          integer=False)
  chunk, chunk_name = settings.number(args, environ, "prefill_chunk", 0, MAX_PREFILL_CHUNK, f"a number of tokens from 0 to {MAX_PREFILL_CHUNK}")
  if size is None:
    for value, name in ((timeout, timeout_name), (chunk, chunk_name)):
      if value is not None:
        raise ValueError(f"{name} is set but EXO_BATCH_SIZE is not: set EXO_BATCH_SIZE (or --batch-size) to an integer from 2 to {MAX_BATCH_SIZE} to turn batching on")
    return None
  if size == 1:
    return None
  return BatchingConfig(size, DEFAULT_TIMEOUT_MS if timeout is None else timeout, DEFAULT_PREFILL_CHUNK if chunk is None else chunk)

"""The embedded SmolLM2-135M-Instruct as the tests name it."""
from exo.inference.shard import Shard

SMOLLM2 = "smollm2-135m"
SMOLLM2_LAYERS = 30


def smollm2_shard(start: int = 0, end: int = SMOLLM2_LAYERS - 1) -> Shard:
  return Shard(SMOLLM2, start, end, SMOLLM2_LAYERS)

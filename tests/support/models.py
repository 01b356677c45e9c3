"""The embedded SmolLM2-135M-Instruct as the tests name it, and prompts for it."""
import random
from typing import List, Sequence, Tuple

from exo.inference.shard import Shard

SMOLLM2 = "smollm2-135m"
SMOLLM2_LAYERS = 30


def smollm2_shard(start: int = 0, end: int = SMOLLM2_LAYERS - 1) -> Shard:
  return Shard(SMOLLM2, start, end, SMOLLM2_LAYERS)


WORDS = "sun river stone apple cloud music garden ocean paper window silver forest".split()


def random_arrivals(n: int, seed: int, word_counts: Sequence[int], max_delay_s: float = 1.0) -> List[Tuple[str, float]]:
  """n prompts of different lengths (a number of words from word_counts), each with its arrival delay."""
  rng = random.Random(seed)
  return [(f"Story {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.choice(word_counts))), rng.uniform(0, max_delay_s)) for i in range(n)]

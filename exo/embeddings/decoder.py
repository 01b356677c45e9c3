"""A decoder as an embedding model's transformer (Qwen3-Embedding): the numpy engine's own decoder
(exo/inference/numpy/llama.py) run prefill-only, its final-normed states per position for the pooling to take.

A batch is packed, not padded: the inputs' rows go through each weight product together as one step of the chat
engine does, and each input attends only to its own positions, causally, through a KV-cache slot of its own that is
dropped after the pass. No padding token enters any input's attention, so a row's states are the same alone or
batched; sentence-transformers pads Qwen3-Embedding's batches on the left and masks the padding, which gives the same
states (RoPE sees only distances between positions), and its last-token pooling takes each row's last state, as
ours does. An input longer than CHUNK goes through in pieces, each attending to the pieces before it in its cache,
so one pass never holds a long input's whole attention matrix."""
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from exo.inference.numpy.kernels import Workers
from exo.inference.numpy.llama import Llama
from exo.inference.shard import Shard
from exo.inference.weights import load_config, load_hf_dir

CHUNK = 512  # an input's positions per pass at most


class DecoderStates:
  def __init__(self, path: Path):
    config = load_config(path)
    shard = Shard(str(path), 0, config.n_layers - 1, config.n_layers)
    _, weights = load_hf_dir(path, shard)
    # sentence-transformers saves the base model (no head): its tensors lack the causal LM's `model.` prefix
    weights = {name if name.startswith(("model.", "lm_head.")) else f"model.{name}": w for name, w in weights.items()}
    self.decoder = Llama(config, shard, weights)
    self.vocab_size, self.hidden_size, self.max_positions = config.vocab_size, config.hidden_size, config.max_position_embeddings

  def states(self, inputs: Sequence[Sequence[int]], workers: Optional[Workers], pause: Callable[[], None]) -> Tuple[np.ndarray, np.ndarray]:
    """(states (rows, longest, hidden), mask (rows, longest)): each input's final-normed states on the left of its
    row, then zeros; mask 1 on its positions. `pause()` between the passes of inputs longer than CHUNK."""
    caches = [self.decoder.new_cache() for _ in inputs]
    pieces: List[List[np.ndarray]] = [[] for _ in inputs]
    done = [0] * len(inputs)
    while True:
      running = [i for i, ids in enumerate(inputs) if done[i] < len(ids)]
      if not running:
        break
      if any(done):
        pause()
      chunks = [np.asarray(inputs[i][done[i]:done[i] + CHUNK], dtype=np.int64) for i in running]
      for i, chunk, out in zip(running, chunks, self.decoder.final_states(chunks, [caches[i] for i in running], workers)):
        pieces[i].append(out)
        done[i] += len(chunk)
    length = max(done)
    states = np.zeros((len(inputs), length, self.hidden_size), dtype=np.float32)
    mask = np.zeros((len(inputs), length), dtype=np.int64)
    for row, parts in enumerate(pieces):
      states[row, :done[row]] = np.concatenate(parts)
      mask[row, :done[row]] = 1
    return states, mask

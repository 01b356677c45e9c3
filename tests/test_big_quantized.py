"""bench/big_quantized.py's checkpoint at a tiny size: a random Llama written straight as GGUF Q4_0 with SmolLM2's
tokenizer reads back with the shape asked for, and the numpy engine's model holds it at Q4_0's size (0.625 bytes a
weight, under the 0.7 the 1B run is held to), computing finite logits."""
import numpy as np
import pytest

from bench.big_quantized import checkpoint_shape, held_bytes, parameters, write_checkpoint
from exo.inference.numpy.llama import Llama
from exo.inference.shard import Shard
from exo.inference.tokenizers import resolve_tokenizer
from exo.inference.weights import load_shard_weights

pytestmark = pytest.mark.model

SHAPE = {"layers": 2, "hidden": 128, "intermediate": 256, "heads": 4, "kv_heads": 2, "vocab": 49152}


def test_a_random_q4_0_llama_is_held_at_its_files_size(tmp_path):
  path = tmp_path / "tiny-q4_0.gguf"
  write_checkpoint(path, SHAPE)
  assert checkpoint_shape(path) == SHAPE
  shard = Shard(str(path), 0, SHAPE["layers"] - 1, SHAPE["layers"])
  config, weights = load_shard_weights(path, shard, keep_quantized=True)
  model = Llama(config, shard, weights)
  held = held_bytes([model.layers, model.head, model.embed, model.norm])
  norms = (2 * SHAPE["layers"] + 1) * SHAPE["hidden"] * 4  # float32
  assert 0.62 <= (held - norms) / (parameters(SHAPE) - norms / 4) <= 0.63  # 20 bytes a block of 32 weights: codes, float16 scale and bias
  assert held / parameters(SHAPE) <= 0.7
  tokenizer = resolve_tokenizer(path)
  ids = np.array(tokenizer.encode("The capital of France is"))
  assert tokenizer.decode(ids) == "The capital of France is"
  logits = model.forward([ids], [model.new_cache()])[0]
  assert logits.shape == (1, SHAPE["vocab"]) and np.isfinite(logits).all()

"""The fused decode pass (exo/inference/numpy/fused_decode.py, kernels_c/decoder.c) gives the logits llama.py's
layers give, step after step, for 1, 3 and 8 decode rows of requests at different cache lengths, on one core and
shared among OpenMP's threads; and a model with a feature it does not compute is left to llama.py's layers.

Both passes do the same float32 operations but sum in other orders (the RMS norms, SiLU's exp from libm rather than
numpy): on the embedded SmolLM2 the logits (up to about 30) differ by at most 6e-5 (measured), held here to LOGITS_ATOL,
and every step's greedy token is the same."""
import numpy as np
import pytest

from exo.inference.numpy import kernels, packed
from exo.inference.numpy.llama import Llama
from exo.inference.shard import Shard
from exo.inference.weights import load_config, load_shard_weights
from tests.test_architectures import FIXTURES

pytestmark = pytest.mark.model

LOGITS_ATOL = 1e-3
STEPS = 3


def whole_model(path, **load) -> Llama:
  n_layers = load_config(path).n_layers
  shard = Shard(str(path), 0, n_layers - 1, n_layers)
  config, weights = load_shard_weights(path, shard, keep_quantized=True, **load)
  return Llama(config, shard, weights)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
  return whole_model(smollm2_path)


def fused_against_layers(model: Llama, rows: int, shared: bool, seed: int = 0) -> float:
  """The largest logit difference over STEPS decode steps of `rows` requests (cache lengths 5, 22, 39, ...), fused
  against llama.py's layers from equal caches; asserts the fused pass ran where it takes the step and the greedy tokens
  agree."""
  fused, shared_decode = model.fused_decode, model.shared_decode
  assert fused is not None
  runs = []
  run = fused.run
  fused.run = lambda h, step: runs.append(step.rows) or run(h, step)
  model.shared_decode = None  # the step's choice made here, not timed
  kernels.set_step_shared(shared)
  rng = np.random.default_rng(seed)
  vocab = model.config.vocab_size
  try:
    prompts = [rng.integers(3, vocab, 5 + 17 * i) for i in range(rows)]
    by_fused, by_layers = [model.new_cache() for _ in range(rows)], [model.new_cache() for _ in range(rows)]
    model.fused_decode = None
    model.forward(prompts, by_fused)
    model.forward(prompts, by_layers)
    worst = 0.0
    for _ in range(STEPS):
      tokens = [rng.integers(3, vocab, 1) for _ in range(rows)]
      model.fused_decode = fused
      got = np.concatenate(model.forward(tokens, by_fused))
      model.fused_decode = None
      want = np.concatenate(model.forward(tokens, by_layers))
      np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)
      assert (got.argmax(-1) == want.argmax(-1)).all()
      worst = max(worst, float(np.abs(got - want).max()))
  finally:
    kernels.set_step_shared(False)
    fused.run = run
    model.fused_decode, model.shared_decode = fused, shared_decode
  takes = rows == 1 or (shared and packed._parallel["usable"])
  assert runs == ([rows] * STEPS if takes else []), "the fused pass ran where it does not take the step, or not where it does"
  return worst


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_smollm2_decode_steps_fused_equal_the_layers(smollm2, rows, shared):
  assert smollm2.fused_decode is not None, "the embedded SmolLM2 (plain Llama layers, quantized) is the fused pass's model"
  fused_against_layers(smollm2, rows, shared)


@pytest.mark.parametrize("bits", [8, 4])
def test_biases_and_other_group_sizes_fused_equal_the_layers(bits):
  """Llama with q/k/v and output biases, quantized as it loads (groups of 64: the kernels' multi-vector groups)."""
  model = whole_model(FIXTURES / "llama_attention_bias", quantize=bits)
  assert any(layer["o_bias"] is not None for layer in model.layers)
  for rows, shared in ((1, False), (3, True)):
    fused_against_layers(model, rows, shared)


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "granite", "olmo2", "mixtral"])
def test_a_model_with_features_the_fused_pass_lacks_runs_the_layers(name):
  """Query/key norms (Qwen3), post norms, softcaps and sliding windows (Gemma 2), residual scaling (Granite),
  projection norms (OLMo 2), experts (Mixtral): llama.py's layers, which still decode."""
  model = whole_model(FIXTURES / name, quantize=8)
  assert model.fused_decode is None
  cache = [model.new_cache()]
  model.forward([np.arange(3, 9)], cache)
  logits = model.forward([np.array([5])], cache)[0]
  assert np.isfinite(logits).all()


def test_float_weights_and_a_float16_cache_run_the_layers():
  path = FIXTURES / "llama"
  assert whole_model(path).fused_decode is None  # bfloat16 weights, kept as float32
  model = whole_model(path, quantize=8)
  assert model.fused_decode is not None
  weights = load_shard_weights(path, model.shard, keep_quantized=True, quantize=8)[1]
  assert Llama(model.config, model.shard, weights, kv_dtype=np.float16).fused_decode is None


def test_only_few_decode_rows_take_the_fused_pass(smollm2):
  """A prompt's rows, or more than DIRECT_ROWS decode rows, take the layers; one decode row the fused pass."""
  model, calls = smollm2, []
  run = model.fused_decode.run
  model.fused_decode.run = lambda h, step: calls.append(step.rows) or run(h, step)
  shared_decode, model.shared_decode = model.shared_decode, None
  kernels.set_step_shared(True)
  try:
    caches = [model.new_cache() for _ in range(packed.DIRECT_ROWS + 1)]
    model.forward([np.arange(3, 10) for _ in caches], caches)
    model.forward([np.array([7]) for _ in caches], caches)
    assert calls == []
    model.forward([np.array([7])], caches[:1])
    assert calls == [1]
  finally:
    kernels.set_step_shared(False)
    model.fused_decode.run, model.shared_decode = run, shared_decode


def test_two_shards_fused_equal_the_whole_model(smollm2, smollm2_path):
  """A pipeline's shards each run their own layers fused (hidden states in, hidden states out), as the whole model."""
  n_layers = smollm2.config.n_layers
  shards = []
  for start, end in ((0, 11), (12, n_layers - 1)):
    shard = Shard(str(smollm2_path), start, end, n_layers)
    config, weights = load_shard_weights(smollm2_path, shard, keep_quantized=True)
    shards.append(Llama(config, shard, weights))
  assert all(model.fused_decode is not None for model in shards)
  whole_cache, shard_caches = [smollm2.new_cache()], [[model.new_cache()] for model in shards]
  prompt = np.arange(40, 60)
  steps = [prompt] + [np.array([token]) for token in (71, 502, 9)]
  for tokens in steps:
    want = smollm2.forward([tokens], whole_cache)[0]
    hidden = shards[0].forward([tokens], shard_caches[0])[0]
    got = shards[1].forward([hidden], shard_caches[1])[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)

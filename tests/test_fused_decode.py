"""The fused decode pass (exo/inference/numpy/fused_decode.py, kernels_c/decoder.c) gives the logits llama.py's
layers give, step after step, for 1, 3 and 8 decode rows of requests at different cache lengths (the direct
products) and 16 (the panels), on one core and shared among OpenMP's threads, taking the step whole (embedding to logits in one call) where the shard's ends are
quantized; and a model with a feature it does not compute is left to llama.py's layers.

Both passes do the same float32 operations but sum in other orders (the RMS norms, SiLU's exp from libm rather than
numpy): on the embedded SmolLM2 the logits (up to about 30) differ by at most 6e-5 (measured), held here to LOGITS_ATOL,
and every step's greedy token is the same."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from exo.inference.numpy import kernels, packed
from exo.inference.numpy.fused_decode import FusedDecode
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


def recording(fused, runs: list):
  """Patches `fused` to note each step it takes, as ("whole", rows) or ("layers", rows); returns the undo."""
  run, whole = fused.run, fused.step

  def step(inputs, caches):
    out = whole(inputs, caches)
    if out is not None:
      runs.append(("whole", len(inputs)))
    return out
  fused.run = lambda h, step: runs.append(("layers", step.rows)) or run(h, step)
  fused.step = step

  def undo():
    fused.run, fused.step = run, whole
  return undo


def fused_against_layers(model: Llama, rows: int, shared: bool, seed: int = 0, fused=None) -> float:
  """The largest logit difference over STEPS decode steps of `rows` requests (cache lengths 5, 22, 39, ...), fused
  (the model's own pass, or `fused`) against llama.py's layers from equal caches; asserts the fused pass ran where it
  takes the step, whole where the model's ends are compiled, and the greedy tokens agree."""
  own, shared_decode = model.fused_decode, model.shared_decode
  fused = fused or own
  assert fused is not None
  runs = []
  undo = recording(fused, runs)
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
    undo()
    model.fused_decode, model.shared_decode = own, shared_decode
  takes = rows == 1 or (shared and packed._parallel["usable"]) or kernels.CORES == 1
  how = "whole" if fused.whole else "layers"
  assert runs == ([(how, rows)] * STEPS if takes else []), "the fused pass ran where it does not take the step, or not where it does"
  return worst


@pytest.mark.parametrize("rows, shared", [(1, False), (1, True), (3, False), (3, True), (8, False), (8, True), (16, True)])
def test_smollm2_decode_steps_fused_equal_the_layers(smollm2, rows, shared):
  assert smollm2.fused_decode is not None, "the embedded SmolLM2 (plain Llama layers, quantized) is the fused pass's model"
  assert smollm2.fused_decode.whole and smollm2.fused_decode.embeds, "its tied 8-bit embedding and head are compiled: whole steps"
  fused_against_layers(smollm2, rows, shared)


def test_on_a_machine_of_one_core_several_rows_take_the_fused_pass_unshared(smollm2, monkeypatch):
  """One core: no engine threads to share llama.py's columns among, so several decode rows run here on it."""
  monkeypatch.setattr(kernels, "CORES", 1)
  fused_against_layers(smollm2, 3, shared=False)


def test_more_threads_than_cores_take_each_others_tasks_and_still_equal_the_layers(smollm2_path):
  """Seven OpenMP threads on this machine's cores (in a process of its own: the thread count is read as OpenMP
  starts): the kernel deschedules them constantly, so threads take what is left of others' ranges (decoder.c's
  phase), with ranges of uneven length; the steps must still equal llama.py's layers."""
  script = textwrap.dedent(f"""
    from tests.test_fused_decode import fused_against_layers, whole_model
    model = whole_model({str(smollm2_path)!r})
    for rows in (1, 3, 8, 11):
      fused_against_layers(model, rows, shared=True, seed=rows)
    print("equal")
  """)
  done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "OMP_NUM_THREADS": "7"}, capture_output=True,
                        text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
  assert done.returncode == 0 and "equal" in done.stdout, done.stderr[-3000:]


@pytest.mark.parametrize("shared", [False, True])
def test_smollm2_layers_alone_fused_equal_the_layers(smollm2, shared):
  """The layers fused with the ends left to llama.py (what a shard whose head the kernels cannot read runs)."""
  fused_against_layers(smollm2, 3 if shared else 1, shared, fused=FusedDecode(smollm2, whole_steps=False))


def test_a_whole_step_refuses_a_token_outside_the_vocabulary_and_leaves_the_caches(smollm2):
  caches = [smollm2.new_cache() for _ in range(2)]
  smollm2.forward([np.arange(3, 9), np.arange(3, 12)], caches)
  kernels.set_step_shared(True)
  try:
    with pytest.raises(IndexError):
      smollm2.fused_decode.step([np.array([5]), np.array([smollm2.config.vocab_size])], caches)
    assert [cache.length for cache in caches] == [6, 9]
  finally:
    kernels.set_step_shared(False)
  assert smollm2.fused_decode.step([np.array([5])], caches[:1]) is not None
  assert caches[0].length == 7


@pytest.mark.parametrize("bits", [8, 4])
def test_biases_and_other_group_sizes_fused_equal_the_layers(bits):
  """Llama with q/k/v and output biases, quantized as it loads (groups of 64: the kernels' multi-vector groups)."""
  model = whole_model(FIXTURES / "llama_attention_bias", quantize=bits)
  assert any(layer["o_bias"] is not None for layer in model.layers)
  for rows, shared in ((1, False), (3, True), (10, True)):
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


def test_only_few_decode_rows_take_the_fused_pass(smollm2, monkeypatch):
  """A prompt's rows, or more than MOST_ROWS decode rows, take the layers; one decode row the fused pass, and up to
  MOST_ROWS shared (more than DIRECT_ROWS: by the panels)."""
  model, calls = smollm2, []
  monkeypatch.setattr(FusedDecode, "MOST_ROWS", packed.DIRECT_ROWS + 1)  # (few rows: a quick test)
  undo = recording(model.fused_decode, calls)
  shared_decode, model.shared_decode = model.shared_decode, None
  kernels.set_step_shared(True)
  try:
    caches = [model.new_cache() for _ in range(packed.DIRECT_ROWS + 2)]
    model.forward([np.arange(3, 10) for _ in caches], caches)
    model.forward([np.array([7]) for _ in caches], caches)
    assert calls == []
    model.forward([np.array([7])], caches[:1])
    model.forward([np.array([7]) for _ in caches[1:]], caches[1:])
    assert calls == [("whole", 1), ("whole", packed.DIRECT_ROWS + 1)]
    kernels.set_step_shared(False)  # several rows on one core: llama.py's layers share them among the engine's threads
    model.forward([np.array([7]) for _ in caches[1:]], caches[1:])
    assert calls == [("whole", 1), ("whole", packed.DIRECT_ROWS + 1)]
  finally:
    kernels.set_step_shared(False)
    undo()
    model.shared_decode = shared_decode


def test_two_shards_fused_equal_the_whole_model(smollm2, smollm2_path):
  """A pipeline's shards each run their own layers fused (hidden states in, hidden states out), as the whole model."""
  n_layers = smollm2.config.n_layers
  shards = []
  for start, end in ((0, 11), (12, n_layers - 1)):
    shard = Shard(str(smollm2_path), start, end, n_layers)
    config, weights = load_shard_weights(smollm2_path, shard, keep_quantized=True)
    shards.append(Llama(config, shard, weights))
  assert all(model.fused_decode is not None for model in shards)
  first, last = (model.fused_decode for model in shards)
  assert (first.first, first.last, last.first, last.last) == (True, False, False, True)
  runs = [[], []]
  undo = [recording(first, runs[0]), recording(last, runs[1])]
  whole_cache, shard_caches = [smollm2.new_cache()], [[model.new_cache()] for model in shards]
  prompt = np.arange(40, 60)
  steps = [prompt] + [np.array([token]) for token in (71, 502, 9)]
  try:
    for tokens in steps:
      want = smollm2.forward([tokens], whole_cache)[0]
      hidden = shards[0].forward([tokens], shard_caches[0])[0]
      got = shards[1].forward([hidden], shard_caches[1])[0]
      np.testing.assert_allclose(got, want, rtol=0, atol=LOGITS_ATOL)
  finally:
    [u() for u in undo]
  assert runs == [[("whole", 1)] * 3] * 2, "each shard's decode steps whole: token ids to hidden states, hidden states to logits"


def test_a_head_the_kernels_do_not_read_leaves_the_ends_to_the_layers_path():
  """Float head weights (here the quantized head widened back): the layers fused, the norm and head in numpy."""
  model = whole_model(FIXTURES / "llama", quantize=8)
  assert model.fused_decode.whole
  model.head = np.ascontiguousarray(model.head.dequantize().T)  # (in, out) float32, as kernels.weight_matrix keeps it
  model.embed = model.head
  model.fused_decode = FusedDecode.build(model)
  assert not model.fused_decode.whole and not model.fused_decode.embeds
  fused_against_layers(model, 1, False)

"""A float checkpoint quantized as it loads (--quantize 8|4): the small random checkpoints of every family
(tests/fixtures/models, bfloat16) run by the numpy engine against the same checkpoints run in float32.

8 bits: the same greedy tokens, the last prompt position's logits within 3% RMS of the float ones (measured 1.3-2.9%).
4 bits: random weights are the hardest case for 16 levels a group (no outliers to spare, every weight as large as
the rest), and on these 2-layer models the logits move by 21-46% RMS; the test holds them to that and to the ratio of
the two widths' errors, which is what the arithmetic gives (2**8 - 1 steps against 2**4 - 1: measured 12-19x).
The held weights shrink to bits / 8 + 4 / 64 bytes a weight (a float16 scale and bias a group of 64), a mixture of
experts' experts included."""
import json

import numpy as np
import pytest

from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.inference.numpy.packed import PackedMatrix
from exo.inference.quantize import group_size, held_bytes
from exo.inference.shard import Shard
from exo.inference.weights import load_shard_weights
from tests.test_architectures import EXPECTED, FIXTURES, greedy, model_class

pytestmark = pytest.mark.model

FAMILIES = ["llama", "qwen3", "phi3", "gemma2", "granite", "mixtral", "qwen3_moe"]


def model(name: str, bits, cut=None, engine: str = "numpy"):
  """The checkpoint as one model, or as two shards split after layer `cut`."""
  n_layers = json.loads((FIXTURES / name / "config.json").read_text())["num_hidden_layers"]
  bounds = [-1, n_layers - 1] if cut is None else [-1, cut, n_layers - 1]
  models = []
  for start, end in zip(bounds, bounds[1:]):
    shard = Shard(name, start + 1, end, n_layers)
    config, weights = load_shard_weights(FIXTURES / name, shard, keep_quantized=True, quantize=bits)
    models.append(model_class(engine)(config, shard, weights))
  return models


def relative_rms(got: np.ndarray, want: np.ndarray) -> float:
  return float(np.sqrt(((got - want) ** 2).mean() / (want ** 2).mean()))


@pytest.fixture(scope="module")
def runs():
  out = {}
  for name in FAMILIES:
    prompt, n = EXPECTED[name]["prompt"], len(EXPECTED[name]["tokens"])
    out[name] = {bits: greedy(model(name, bits), [prompt], n) for bits in (None, 8, 4)}
  return out


@pytest.mark.parametrize("name", FAMILIES)
def test_eight_bits_give_the_float_checkpoints_greedy_tokens(runs, name):
  (want, [float_logits]), (got, [logits]) = runs[name][None], runs[name][8]
  assert got == want
  assert relative_rms(logits, float_logits) < 0.03


@pytest.mark.parametrize("name", FAMILIES)
def test_four_bits_move_the_logits_as_far_as_sixteen_levels_do(runs, name):
  [float_logits] = runs[name][None][1]
  errors = {bits: relative_rms(runs[name][bits][1][0], float_logits) for bits in (8, 4)}
  assert errors[4] < 0.5
  assert errors[4] > 8 * errors[8]


def test_a_pipeline_of_two_quantized_shards_answers_as_one_model():
  prompt, n = EXPECTED["llama"]["prompt"], len(EXPECTED["llama"]["tokens"])
  assert greedy(model("llama", 8, cut=0), [prompt], n)[0] == greedy(model("llama", 8), [prompt], n)[0]


@pytest.mark.parametrize("bits", [8, 4])
def test_the_weights_held_shrink_to_the_bits_asked_for(bits):
  floats, = model("llama", None)
  quantized, = model("llama", bits)

  def matrices(m):
    return [w for layer in m.layers for w in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])] + [m.head]
  assert all(isinstance(w, PackedMatrix) for w in matrices(quantized)) and quantized.embed is None  # tied: the head serves lookups
  assert not any(isinstance(w, PackedMatrix) for w in matrices(floats))
  count = sum(w.size for w in matrices(floats))
  assert sum(w.nbytes for w in matrices(floats)) == 4 * count
  assert sum(w.nbytes for w in matrices(quantized)) == count * held_bytes(bits)


def test_the_engine_quantizes_what_it_loads_when_told(tmp_path):
  from tests.support.checkpoints import fixture_checkpoint
  path = fixture_checkpoint("qwen3", tmp_path / "qwen3")
  engine = NumpyDynamicShardInferenceEngine(None)
  engine.quantize_bits = 4
  engine._load(path, Shard("qwen3", 0, 1, 2))
  layer = engine.model.layers[0]
  assert all(isinstance(layer[k], PackedMatrix) and layer[k].bits == 4 for k in ("qkv", "o", "gate_up", "down"))
  assert isinstance(engine.model.head, PackedMatrix) and engine.model.head.bits == 4


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_a_mixture_of_experts_holds_its_experts_quantized(name):
  floats, = model(name, None)
  quantized, = model(name, 4)
  experts = lambda m: [w for layer in m.layers if layer["experts"] is not None for pair in layer["experts"] for w in pair]
  assert experts(quantized) and all(isinstance(w, PackedMatrix) and w.bits == 4 for w in experts(quantized))
  assert all(isinstance(layer["router"], np.ndarray) for layer in quantized.layers if layer["experts"] is not None)  # routers stay float
  assert [int(np.prod(w.shape)) for w in experts(quantized)] == [w.size for w in experts(floats)]
  # groups of 64 inputs, or 32 where 64 does not divide them (qwen3_moe's down projection: 32 inputs)
  assert sum(w.nbytes for w in experts(quantized)) == sum(np.prod(w.shape) * held_bytes(4, group_size(w.shape[1])) for w in experts(quantized))


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_the_mlx_engine_runs_quantized_experts_as_numpy_does(runs, name):
  """MLX takes each layer's quantized experts as one stack (gather_qmm): 8 bits give the float checkpoint's tokens."""
  prompt, n = EXPECTED[name]["prompt"], len(EXPECTED[name]["tokens"])
  models = model(name, 8, engine="mlx")
  stacks = [layer[k] for m in models for layer in m.layers for k in ("experts_gate_up", "experts_down") if layer.get(k) is not None]
  assert stacks and all(stack.quantized is not None for stack in stacks)
  assert greedy(models, [prompt], n)[0] == runs[name][None][0]

"""The memory a model takes, as the figures count it before anything loads: the KV cache a request needs
(admission's ModelLimits), the reserve and the weights placement sizes a copy by (exo/topology), each as the
architecture really stores it: a sliding-window layer holds its window, multi-head latent attention its latent, and
an expert model's every expert, shared expert and dense layer."""
import math
from dataclasses import replace
from pathlib import Path

import pytest

from exo.api.model_limits import ModelLimits
from exo.inference.weights import _safetensors_header, load_config
from exo.topology.model_size import KV_RESERVE_POSITIONS, KV_RESERVE_STREAMS, _checkpoint_shape, shape_of, weight_bytes
from exo.topology.placement import MemberFacts, _Costs

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "fixtures" / "models"
NUMPY = "NumpyDynamicShardInferenceEngine"


def tensor_sizes(name: str) -> dict:
  """Each tensor's element count, as the fixture's safetensors header gives it; an MXFP4 tensor's (`_blocks`, two
  weights a byte) its weights, its scales none."""
  sizes = {}
  for file in (FIXTURES / name).glob("*.safetensors"):
    header, _ = _safetensors_header(file)
    sizes.update({tensor: math.prod(t["shape"]) * (2 if tensor.endswith("_blocks") else 1) for tensor, t in header.items()
                  if tensor != "__metadata__" and not tensor.endswith("_scales")})
  return sizes


def test_a_sliding_layer_counts_at_most_its_window_in_admission_where_the_engine_keeps_only_the_window():
  """gpt-oss's fixture: layer 0 slides over 4 positions, layer 1 attends to all; K and V of 2 heads of 16."""
  from exo.inference.dummy_inference_engine import DummyInferenceEngine
  from exo.inference.mlx.engine import MLXDynamicShardInferenceEngine
  from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
  from exo.inference.tinygrad.engine import TinygradDynamicShardInferenceEngine
  assert NumpyDynamicShardInferenceEngine.kv_keeps_window and MLXDynamicShardInferenceEngine.kv_keeps_window
  assert not TinygradDynamicShardInferenceEngine.kv_keeps_window and not DummyInferenceEngine.kv_keeps_window
  config = load_config(FIXTURES / "gpt_oss")
  limits = ModelLimits.of(config, 4, keeps_window=True)
  per_layer = 2 * 2 * 16 * 4
  assert limits.kv_bytes_per_position_per_layer == per_layer and (limits.sliding_window, limits.sliding_layers) == (4, (0,))
  assert limits.kv_bytes(100, range(2)) == (4 + 100) * per_layer
  assert limits.kv_bytes(100, range(0, 1)) == 4 * per_layer  # a node that holds the sliding layer only
  assert limits.kv_bytes(100, range(1, 2)) == 100 * per_layer
  assert limits.kv_bytes(3, range(2)) == 2 * 3 * per_layer  # within the window: every position
  assert ModelLimits.of(config, 4).kv_bytes(100, range(2)) == 2 * 100 * per_layer  # tinygrad's cache keeps every position


def test_gemma3s_five_sliding_layers_of_six_and_a_model_without_a_window():
  full_size = replace(load_config(FIXTURES / "gemma3_text"), n_layers=12, sliding_window=1024,
                      sliding_layers=tuple(i for i in range(12) if (i + 1) % 6))
  limits = ModelLimits.of(full_size, 2, keeps_window=True)
  assert limits.kv_bytes(32768, range(12)) == (10 * 1024 + 2 * 32768) * limits.kv_bytes_per_position_per_layer
  plain = ModelLimits.of(load_config(FIXTURES / "mistral"), 4, keeps_window=True)
  assert plain.kv_bytes(5000, range(2)) == 2 * 5000 * plain.kv_bytes_per_position_per_layer


def test_latent_attention_counts_its_latent_in_admission():
  """DeepSeek-V3's fixture caches kv_lora_rank + qk_rope_head_dim (32 + 8) values a position and layer."""
  limits = ModelLimits.of(load_config(FIXTURES / "deepseek_v3"), 4, keeps_window=True)
  assert limits.kv_bytes(100, range(3)) == 100 * 3 * (32 + 8) * 4


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").exists()))
def test_a_models_layers_weigh_what_its_checkpoint_holds(name):
  """Every tensor of the decoder's layers, summed from the checkpoint's header, against the config's count: latent
  attention's projections and norms, biases, sinks, q/k norms, routers, every expert and shared expert, dense
  layers beside MoE ones."""
  layers = sum(n for tensor, n in tensor_sizes(name).items() if ".layers." in tensor and "vision" not in tensor)
  assert load_config(FIXTURES / name).layer_parameters() == layers


@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss", "qwen3_moe", "gemma2"])
def test_placements_weight_estimate_for_a_checkpoint_is_its_parameter_bytes(name):
  """A whole copy's bytes as placement counts them, less its KV reserve, against the checkpoint's every tensor
  at float32: within 1%. DeepSeek-V3's layers counted as placement did before (its attention as q, k, v and o of the
  hidden width, the MLP from an average width) missed the real weights by over 5% here."""
  path = str(FIXTURES / name)
  shape = _checkpoint_shape(path)
  n_layers = load_config(path).n_layers
  costs = _Costs(path, n_layers, shape)
  facts = MemberFacts("a", NUMPY, 4, 1000, 1.0, "auto")
  weights = costs.bytes(facts, 0, n_layers - 1) - shape.kv_reserve(0, n_layers - 1) * 4
  real = sum(tensor_sizes(name).values()) * 4
  assert abs(weights - real) / real < 0.01, (weights, real)
  if name == "deepseek_v3":
    h = shape.hidden
    four_square = 2 * h * h + 2 * h * shape.kv_dim + 3 * h * shape.intermediate + 2 * h
    assert abs(four_square - shape.layer_weights) / shape.layer_weights > 0.05


def test_placements_kv_reserve_holds_a_sliding_layers_window_per_stream():
  stream = KV_RESERVE_POSITIONS // KV_RESERVE_STREAMS
  gpt_oss = shape_of("gpt-oss-20b")  # 24 layers, the even ones sliding over 128 positions
  assert gpt_oss.sliding_layers == tuple(range(0, 24, 2)) and gpt_oss.window == 128 < stream
  assert gpt_oss.kv_reserve(0, 23) == (12 * KV_RESERVE_POSITIONS + 12 * KV_RESERVE_STREAMS * 128) * gpt_oss.kv_per_position
  assert gpt_oss.kv_reserve(1, 1) == KV_RESERVE_POSITIONS * gpt_oss.kv_per_position
  gemma3 = shape_of("gemma-3-1b")  # 26 layers, five of six sliding over 512
  assert len(gemma3.sliding_layers) == 26 - 4 and 5 not in gemma3.sliding_layers
  assert gemma3.kv_reserve(0, 5) == (KV_RESERVE_POSITIONS + 5 * KV_RESERVE_STREAMS * 512) * gemma3.kv_per_position
  assert gpt_oss.kv_reserve(0, 23, keeps_window=False) == 24 * KV_RESERVE_POSITIONS * gpt_oss.kv_per_position  # tinygrad's cache
  tinygrad = MemberFacts("a", "TinygradDynamicShardInferenceEngine", 4, 1000, 1.0, "auto")
  numpy = MemberFacts("a", NUMPY, 4, 1000, 1.0, "auto")
  costs = _Costs("gpt-oss-20b", 24, gpt_oss)
  weights = 24 * gpt_oss.layer_weights + gpt_oss.embedding_weights + gpt_oss.head_weights
  kv = lambda facts: costs.bytes(facts, 0, 23) - weights * weight_bytes(facts.engine, 4, "gpt-oss-20b")  # numpy holds the MXFP4 experts smaller
  assert kv(tinygrad) - kv(numpy) == pytest.approx(12 * (KV_RESERVE_POSITIONS - KV_RESERVE_STREAMS * 128) * gpt_oss.kv_per_position * 4, rel=1e-9)
  gemma2 = shape_of("gemma-2-9b")  # a window wider than a stream: every position counts
  assert gemma2.kv_reserve(0, 41) == 42 * KV_RESERVE_POSITIONS * gemma2.kv_per_position
  local = _checkpoint_shape(str(FIXTURES / "gemma3_text"))  # a checkpoint's own: its layer_types
  assert (local.window, local.sliding_layers) == (4, (0, 1))
  assert local.kv_reserve(0, 2) == (KV_RESERVE_POSITIONS + 2 * KV_RESERVE_STREAMS * 4) * local.kv_per_position


def test_the_registry_marks_the_sliding_models_as_their_configs_do():
  """Each sliding shape's layers as its config's rule gives them (gemma2.sliding_layers without layer_types)."""
  from exo.inference.models.gemma2 import sliding_layers
  from exo.models import model_cards
  for model_id, every in [("gemma-2-2b", 2), ("gemma-3-27b", 6), ("gpt-oss-120b", 2)]:
    layers = model_cards[model_id]["layers"]
    assert shape_of(model_id).sliding_layers == sliding_layers({"num_hidden_layers": layers}, every)

"""Placement as a pure function of the members' facts and the model's shape (exo/topology/placement.py): which nodes
form groups, and how a group's layers are cut."""
import numpy as np
import pytest

from exo.topology.device_capabilities import measure_gflops
from exo.topology.model_size import KV_RESERVE_POSITIONS, shape_of, weight_bytes
from exo.topology.placement import MIB, MemberFacts, Placement, facts_version, place

pytestmark = pytest.mark.unit

SMOL = "smollm2-135m"
NUMPY = "NumpyDynamicShardInferenceEngine"
NUMPY_KV_BYTES = 4  # the numpy engine's KV cache is float32 (a node with EXO_KV_BITS=16 keeps half; placement is not told)


def member(node_id: str, memory_mb: int, speed: float = 50.0, mode: str = "auto", engine: str = NUMPY, float_bytes: int = 4) -> MemberFacts:
  return MemberFacts(node_id, engine, float_bytes, memory_mb, speed, mode)


def smol(*members: MemberFacts) -> Placement:
  return place(SMOL, 30, members, shape_of(SMOL))


def layout(placement: Placement) -> list:
  return [[(s.node_id, s.start, s.end) for s in g.stages] for g in placement.groups]


def kv_reserve_mb(kv_bytes: int) -> float:
  return 30 * shape_of(SMOL).kv_per_position * KV_RESERVE_POSITIONS * kv_bytes / MIB


def whole_copy_mb(engine: str = NUMPY, float_bytes: int = 4, kv_bytes: int = NUMPY_KV_BYTES) -> float:
  """SmolLM2 as an engine holds it (the numpy engine: the embedded GGUF kept quantized, a float32 KV reserve): what
  one node must offer to hold a copy."""
  s = shape_of(SMOL)
  weights = 30 * s.layer_weights + s.embedding_weights + s.hidden  # tied head: the embedding's matrix, and the final norm
  return weight_bytes(engine, float_bytes, SMOL) * weights / MIB + kv_reserve_mb(kv_bytes)


def test_a_model_that_fits_one_node_is_a_replica_on_every_node():
  placement = smol(member("b", 8000), member("a", 8000), member("c", 8000))
  assert layout(placement) == [[("a", 0, 29)], [("b", 0, 29)], [("c", 0, 29)]]
  assert placement.mode == "auto" and placement.shard_of("b").get_layer_count() == 30


def test_a_model_that_fits_no_single_node_is_a_pipeline_cut_for_equal_stage_times_with_the_head_counted():
  need = whole_copy_mb()
  placement = smol(member("a", int(need * 0.75)), member("b", int(need * 0.75)))
  (group,) = placement.groups
  # The last stage holds the output head (49,152 x 576 weights: 5.3 layers' work, LAYER_WORK): it takes fewer layers.
  assert layout(placement) == [[("b", 0, 17), ("a", 18, 29)]]
  assert group.name == "b+a"


def test_the_copy_needs_its_kv_reserve_too():
  need = whole_copy_mb()
  weights_only = need - kv_reserve_mb(NUMPY_KV_BYTES)
  assert len(smol(member("a", int(need) + 1), member("b", int(need) + 1)).groups) == 2
  assert len(smol(member("a", int(weights_only) + 1), member("b", int(weights_only) + 1)).groups) == 1


def test_the_kv_reserve_is_counted_at_the_width_each_engine_stores_it_in():
  """Each engine's reserve at the width its cache is kept in: tinygrad on a CPU, float32."""
  tinygrad = dict(engine="TinygradDynamicShardInferenceEngine", float_bytes=4)
  need = whole_copy_mb(tinygrad["engine"], 4, kv_bytes=4)
  assert len(smol(member("a", int(need) - 1, **tinygrad), member("b", int(need) - 1, **tinygrad)).groups) == 1
  assert len(smol(member("a", int(need) + 1, **tinygrad), member("b", int(need) + 1, **tinygrad)).groups) == 2


def test_a_faster_node_takes_more_layers():
  need = whole_copy_mb()
  placement = smol(member("a", int(need), speed=100.0), member("b", int(need), speed=50.0), member("x", 100, speed=1.0, mode="pipeline"))
  assert placement.mode == "pipeline"  # the members disagree on the mode: one pipeline over every node, as exo always did
  fast = placement.groups[0].stage_of("a")
  slow = placement.groups[0].stage_of("b")
  assert fast.end - fast.start > slow.end - slow.start


def test_three_nodes_with_one_small_make_two_groups_and_the_small_one_takes_a_share_within_its_memory():
  need = whole_copy_mb()
  placement = smol(member("big1", int(need * 1.2)), member("big2", int(need * 1.2)), member("small", int(need * 0.3)))
  assert [g.node_ids for g in placement.groups] == [("big1", "small"), ("big2",)]
  small = placement.groups[0].stage_of("small")
  assert small.end == 29 and 1 <= small.end - small.start + 1 < 15  # the last layers and the head, what its memory holds


def test_four_small_nodes_make_two_pipelines_of_two():
  need = whole_copy_mb()
  placement = smol(*[member(f"n{i}", int(need * 0.75)) for i in range(4)])
  assert sorted(sorted(g.node_ids) for g in placement.groups) == [["n0", "n1"], ["n2", "n3"]]
  assert all([(s.start, s.end) for s in g.stages] == [(0, 17), (18, 29)] for g in placement.groups)


def test_forced_modes():
  need = whole_copy_mb()
  assert layout(smol(member("a", 8000, mode="pipeline"), member("b", 8000, mode="pipeline"))) == [[("b", 0, 17), ("a", 18, 29)]]
  assert layout(smol(member("a", int(need * 0.5), mode="replicas"), member("b", int(need * 0.5), mode="replicas"))) == [[("a", 0, 29)], [("b", 0, 29)]]


def test_every_node_derives_the_same_placement_from_the_same_facts_in_any_order():
  facts = [member("a", 900), member("b", 700, speed=80.0), member("c", 1500), member("d", 300)]
  placements = [smol(*order) for order in (facts, facts[::-1], facts[1:] + facts[:1])]
  assert len({(p.version, p.groups) for p in placements}) == 1
  assert facts_version(facts) != facts_version(facts[:3])  # a member more or less is another placement


def test_a_model_of_unknown_size_is_one_pipeline_over_every_node():
  placement = place("some-model", 8, [member("a", 8000), member("b", 8000)], None)
  assert placement.mode == "pipeline" and layout(placement) == [[("b", 0, 3), ("a", 4, 7)]]


def test_quantized_weights_take_less_memory():
  need = whole_copy_mb()
  mlx = dict(engine="MLXDynamicShardInferenceEngine", float_bytes=2)
  # The 4-bit Llama 3.2 1B on two 1 GiB nodes: a copy each; in float32 on the same nodes: one pipeline of both.
  assert len(place("llama-3.2-1b", 16, [member("a", 2048, **mlx), member("b", 2048, **mlx)], shape_of("llama-3.2-1b")).groups) == 2
  assert len(place("llama-3.2-1b", 16, [member("a", 2048), member("b", 2048)], shape_of("llama-3.2-1b")).groups) == 1
  # The embedded SmolLM2 (GGUF: Q4_1 layers, Q8_0 embedding) as the numpy engine holds it, kept quantized; tinygrad
  # dequantises it to its float width.
  assert 0.6 < weight_bytes(NUMPY, 4, SMOL) < 0.8 and weight_bytes("TinygradDynamicShardInferenceEngine", 4, SMOL) == 4
  tinygrad = dict(engine="TinygradDynamicShardInferenceEngine")
  fits_quantized = int(need) + 1  # a copy as numpy holds it, not as tinygrad does
  assert len(smol(member("a", fits_quantized), member("b", fits_quantized)).groups) == 2
  assert len(smol(member("a", fits_quantized, **tinygrad), member("b", fits_quantized, **tinygrad)).groups) == 1


def test_gpt_oss_cards_count_their_mxfp4_experts_before_the_files_are_here():
  """gpt-oss as OpenAI ships it: its experts (19 of the 20b's 21 billion weights) in MXFP4, 0.53 bytes a
  weight as numpy and MLX hold them, the rest at the node's float width; tinygrad does not run it at all."""
  from exo.topology.model_size import SHAPES
  shape = SHAPES["gpt-oss-20b"]
  total = 24 * shape.layer_weights + shape.embedding_weights + shape.head_weights
  assert 20.5e9 < total < 21.5e9  # OpenAI's count: 20.9 billion
  for engine, float_bytes in ((NUMPY, 4), ("MLXDynamicShardInferenceEngine", 2)):
    held = weight_bytes(engine, float_bytes, "gpt-oss-20b")
    experts = 24 * 3 * shape.hidden * shape.intermediate
    assert held * total == pytest.approx(experts * (0.5 + 1 / 32) + (total - experts) * float_bytes)
    assert held < 1.0  # numpy: 17 GB (float32 outside the experts), against 84 GB all in float32
  assert weight_bytes(NUMPY, 4, "qwen-3-30b-a3b") == 4  # a bfloat16 repo, held in float32


def test_a_stage_takes_no_more_layers_than_its_memory_holds():
  need = whole_copy_mb()
  placement = smol(member("a", int(need * 0.6)), member("b", int(need * 0.6)))
  first, last = placement.groups[0].stages
  assert (first.end, last.start) == (16, 17)  # 18 layers and the embedding would not fit the first node


def test_the_tui_shows_each_groups_nodes_and_their_layers():
  from rich.console import Console

  from exo.topology.device_capabilities import DeviceCapabilities, DeviceFlops
  from exo.topology.topology import Topology
  from exo.viz.topology_viz import TopologyViz
  need = whole_copy_mb()
  placement = smol(*[member(f"n{i}", int(need * 0.75)) for i in range(4)])
  topology = Topology()
  for i in range(4):
    topology.update_node(f"n{i}", DeviceCapabilities(model="m", chip="c", memory=int(need * 0.75), flops=DeviceFlops(fp32=0, fp16=0, int8=0)))
  viz = TopologyViz()
  viz.update_visualization(topology, [], "n1", {}, {"mode": "auto", "active": True, "version": placement.version,
                                                    "models": {SMOL: {**placement.to_json(), "ready": [True, False]}}})
  console = Console(record=True, width=140)
  console.print(viz.render())
  screen = console.export_text()
  assert f"Placement: auto (version {placement.version})" in screen and "Groups (each serves a whole copy)" in screen
  assert screen.count("0–17 of 30") == 2 and screen.count("18–29 of 30") == 2 and "n1 (this node)" in screen and "loading" in screen


def test_the_speed_measure_ignores_a_moment_of_contention(monkeypatch):
  # A fake clock: each product takes 1 ms, or 4 ms in the first 0.1 s (another process starting on the core); the
  # measure must find the uncontended speed in a later round.
  import time
  now = [0.0]
  real_matmul = np.ndarray.__matmul__

  def clock():
    return now[0]

  def sleep(seconds):
    now[0] += seconds

  class Timed(np.ndarray):
    def __matmul__(self, other):
      now[0] += 0.004 if now[0] < 0.1 else 0.001
      return real_matmul(self, other)

  ones = np.ones
  monkeypatch.setattr(time, "perf_counter", clock)
  monkeypatch.setattr(time, "sleep", sleep)
  monkeypatch.setattr(np, "ones", lambda *a, **k: ones(*a, **k).view(Timed))
  flop = 2 * 32 * 768 * 768
  assert measure_gflops() == float(f"{flop / 0.001 / 1e9:.3g}")


# Published sizes (billions of parameters) of the cards whose id names none, or one rounded by more than 10 per cent
PUBLISHED_SIZE = {"llama-3.2-1b": 1.24, "llama-3.2-1b-8bit": 1.24, "gemma-2-2b": 2.61, "granite-3.1-2b": 2.53, "mistral-nemo": 12.2,
                  "phi-4": 14.7, "smollm2-135m": 0.135}


def test_every_registry_model_has_a_shape_that_weighs_what_the_model_does():
  """Placement sizes a registry model from its shape: each card has one, and its weights add up to the model's size
  (the text model's, for Gemma 3 4B and larger) within the 10 per cent the names round by, so a mistyped figure shows."""
  import re
  from exo.models import model_cards
  assert [m for m in model_cards if shape_of(m) is None] == ["deepseek-r1-distill-qwen-1.5b"]  # its head's tying is not known here
  for model_id, card in model_cards.items():
    shape, named = shape_of(model_id), re.search(r"-(\d+(?:\.\d+)?)b(?:-|$)", model_id)
    if shape is None or model_id == "dummy":
      continue
    weights = card["layers"] * shape.layer_weights + shape.embedding_weights + (0 if shape.tied else shape.head_weights)
    size = PUBLISHED_SIZE.get(model_id) or float(named.group(1))
    assert abs(weights / 1e9 / size - 1) < 0.1, (model_id, weights / 1e9, size)

"""Quantizing a float matrix as it loads (exo/inference/quantize.py): the codes, scales and biases it writes read back
(QuantizedWeight.dequantize, the packed kernels) within half a step of every weight; which tensors it takes; and the
setting's values."""
import numpy as np
import pytest

from exo.inference.numpy.packed import PackedMatrix
from exo.inference.quantize import parse_bits, quantize, quantizes

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("inputs, group", [(128, 64), (96, 32)])
def test_every_weight_reads_back_within_half_a_step(bits, inputs, group):
  rng = np.random.default_rng(bits)
  w = (rng.standard_normal((40, inputs)) * 0.05).astype(np.float32)
  w[3, :group] = 0.25  # a constant group: exact
  q = quantize(w, bits)
  assert (q.group_size, q.bits, q.mode) == (group, bits, "affine") and q.shape == w.shape
  assert q.scales.dtype == q.biases.dtype == np.float16
  back = q.dequantize()
  step = np.repeat(q.scales.astype(np.float32), group, axis=1)
  # half a step from rounding, and a little more where float16's scale falls short of the group's range
  assert (np.abs(back - w) <= 0.5 * step + 2e-3 * np.abs(w).max()).all()
  assert np.abs(back - w).max() < 0.6 * step.max()
  assert (back[3, :group] == np.float32(np.float16(0.25))).all()
  x = rng.standard_normal((1, inputs)).astype(np.float32)
  packed = PackedMatrix.from_quantized(q)
  np.testing.assert_allclose(packed.product(x, 0, 40), x @ back.T, rtol=1e-4, atol=1e-4)


def test_eight_bits_are_sixteen_times_finer_than_four():
  w = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
  error = {bits: np.sqrt(((quantize(w, bits).dequantize() - w) ** 2).mean()) for bits in (8, 4)}
  assert 12 < error[4] / error[8] < 20  # (2**8 - 1) / (2**4 - 1) = 17 steps for one


def test_the_matrices_taken_are_the_ones_mlx_lm_quantizes():
  for name, shape in [("model.embed_tokens.weight", (128, 64)), ("lm_head.weight", (128, 64)), ("model.layers.3.self_attn.q_proj.weight", (128, 64)),
                      ("model.layers.0.self_attn.qkv_proj.weight", (128, 64)), ("model.layers.1.mlp.gate_up_proj.weight", (128, 64)),
                      ("model.layers.1.mlp.down_proj.weight", (128, 64)), ("model.layers.1.self_attn.o_proj.weight", (128, 64)),
                      # experts, as mlx-lm's SwitchLinear: one matrix an expert, shared experts, and every expert's stacked
                      ("model.layers.0.mlp.experts.1.gate_proj.weight", (32, 64)), ("model.layers.0.block_sparse_moe.experts.0.w1.weight", (32, 64)),
                      ("model.layers.0.mlp.shared_experts.down_proj.weight", (64, 32)), ("model.layers.0.mlp.shared_expert.up_proj.weight", (32, 64)),
                      ("model.layers.0.mlp.switch_mlp.gate_proj.weight", (4, 32, 64)), ("model.layers.0.mlp.experts.gate_proj.weight", (4, 32, 64))]:
    assert quantizes(name, shape), name
  for name, shape in [("model.layers.0.input_layernorm.weight", (64,)), ("model.norm.weight", (64,)), ("model.layers.0.self_attn.q_proj.bias", (64,)),
                      ("model.layers.0.mlp.gate.weight", (4, 64)), ("model.layers.0.block_sparse_moe.gate.weight", (4, 64)),  # routers
                      ("model.layers.0.mlp.router.weight", (4, 64)), ("model.layers.0.mlp.shared_expert_gate.weight", (1, 64)),
                      ("model.layers.0.mlp.experts.gate_up_proj", (4, 64, 64)),  # gpt-oss's (experts, in, out): MXFP4 where shipped
                      ("model.layers.0.self_attn.q_proj.weight", (64, 48))]:
    assert not quantizes(name, shape), name


def test_a_stack_of_experts_is_quantized_expert_by_expert():
  stack = np.random.default_rng(2).standard_normal((3, 16, 64)).astype(np.float32)
  q = quantize(stack, 8)
  assert q.shape == (3, 16, 64)
  for e in range(3):
    assert np.array_equal(q[e].dequantize(), quantize(stack[e], 8).dequantize())


@pytest.mark.parametrize("raw, bits", [(None, None), ("", None), ("0", None), ("off", None), ("8", 8), (" 4 ", 4), (4, 4)])
def test_the_setting_reads_bits_or_off(raw, bits):
  assert parse_bits(raw, "--quantize") == bits


@pytest.mark.parametrize("raw", ["3", "16", "eight", "8.0", "-4"])
def test_a_bad_setting_names_itself_and_the_values_it_takes(raw):
  with pytest.raises(ValueError, match=r"^EXO_QUANTIZE must be 8 or 4 .*got '"):
    parse_bits(raw, "EXO_QUANTIZE")

"""Quantized mixture-of-experts weights, read without a model: gpt-oss's MXFP4 blocks as MLX's mxfp4 mode, the numpy
kernels' products over them kept at 4 bits, and mlx-lm's stacked experts one expert at a time."""
import numpy as np
import pytest

from exo.inference.numpy.kernels import full_product, weight_matrix
from exo.inference.quantize import quantize
from exo.inference.quantized import QuantizedWeight, group_mxfp4_blocks, group_quantized, stack_rows

pytestmark = pytest.mark.unit

E2M1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]


def random_mxfp4(rng, experts: int, out: int, inputs: int, exponents=(115, 135)):
  """gpt-oss's tensors (blocks, scales) and the float matrices they hold, decoded as OpenAI's reference does: each
  byte's low nibble the lower input, times 2 ** (scale - 127)."""
  codes = rng.integers(0, 16, size=(experts, out, inputs // 32, 32), dtype=np.uint8)
  scales = rng.integers(*exponents, size=(experts, out, inputs // 32), dtype=np.uint8)
  blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
  values = np.array(E2M1, dtype=np.float64)[codes] * 2.0 ** (scales.astype(np.int64) - 127)[..., None]
  return blocks, scales, values.reshape(experts, out, inputs)


def test_mxfp4_blocks_read_as_the_values_they_hold():
  blocks, scales, values = random_mxfp4(np.random.default_rng(0), 3, 8, 64)
  loaded = group_mxfp4_blocks({"mlp.experts.down_proj_blocks": blocks, "mlp.experts.down_proj_scales": scales, "other": np.ones(2)})
  w = loaded["mlp.experts.down_proj.weight"]
  assert set(loaded) == {"mlp.experts.down_proj.weight", "other"}
  assert (w.mode, w.bits, w.group_size, w.shape) == ("mxfp4", 4, 32, (3, 8, 64))
  assert np.array_equal(w.dequantize(), values.astype(np.float32))
  assert np.array_equal(w[1].dequantize(), values[1].astype(np.float32))


def test_blocks_without_their_scales_are_refused_by_name():
  blocks, _, _ = random_mxfp4(np.random.default_rng(0), 1, 2, 32)
  with pytest.raises(ValueError, match="mlp.experts.gate_up_proj: MXFP4 blocks"):
    group_mxfp4_blocks({"mlp.experts.gate_up_proj_blocks": blocks})


@pytest.mark.parametrize("exponents", [(115, 135), (1, 10), (240, 250)])
def test_the_numpy_kernels_run_mxfp4_kept_at_4_bits(exponents):
  """An MXFP4 matrix held as its own bytes (4-bit codes, a byte's exponent a block, biases taking no memory): rows
  read back exactly, and products equal the float product to float32 rounding, through the direct kernel (a few rows)
  and the widened tiles (many), for powers of two from the smallest the scales hold to nearly the largest."""
  rng = np.random.default_rng(1)
  blocks, scales, values = random_mxfp4(rng, 1, 16, 96, exponents)
  w = group_mxfp4_blocks({"e_blocks": blocks, "e_scales": scales})["e.weight"][0]
  packed = weight_matrix(w)
  assert type(packed).__name__ == "PackedMatrix" and packed.bits == 4
  assert packed.nbytes == blocks.nbytes + scales.nbytes  # the checkpoint's bytes
  assert np.array_equal(packed.dequantize(), values[0].astype(np.float32))
  reordered = packed.take_rows(np.arange(16)[::-1])
  assert reordered.nbytes == packed.nbytes and np.array_equal(reordered.dequantize(), values[0, ::-1].astype(np.float32))
  for rows in (1, 5, 80) if exponents == (115, 135) else (1,):  # (products of the extreme ones leave float32's range)
    x = rng.standard_normal((rows, 96)).astype(np.float32) * np.float32(2.0 ** -100 if exponents[0] > 127 else 1.0)
    want = x @ values[0].T
    np.testing.assert_allclose(full_product(x, packed), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


def test_stacked_experts_read_one_expert_at_a_time():
  """mlx-lm's stacked layout (experts, out, in * bits / 32): read whole, each expert's matrix a view of the stack."""
  rng = np.random.default_rng(2)
  experts = [quantize(rng.standard_normal((8, 64)).astype(np.float32), 4) for _ in range(3)]
  stacked = stack_rows(experts, new_axis=True)
  tensors = {"m.switch_mlp.up_proj.weight": stacked.packed, "m.switch_mlp.up_proj.scales": stacked.scales.astype(np.float32),
             "m.switch_mlp.up_proj.biases": stacked.biases.astype(np.float32)}
  w = group_quantized(tensors, {"group_size": 64, "bits": 4})["m.switch_mlp.up_proj.weight"]
  assert isinstance(w, QuantizedWeight) and w.shape == (3, 8, 64) and len(w) == 3
  assert np.shares_memory(w[2].packed, w.packed)
  for e, expert in enumerate(experts):
    assert np.array_equal(w[e].dequantize(), expert.dequantize())
  assert np.array_equal(w.dequantize(), np.stack([e.dequantize() for e in experts]))

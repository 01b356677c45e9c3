"""GGUF's quantized tensors read as affine groups (quantized.py's QuantizedWeight, MLX's layout), to be kept packed.

Every type here is, per group of inputs, w = scale * code + bias with unsigned codes, which is the form MLX's affine
mode and the numpy engine's kernels take; the values are the ones gguf's own dequantisation gives, exactly (scale *
code + bias is exact in float32 for these scales and codes).
- Q4_0, Q4_1, Q8_0: blocks of 32 with a float16 scale d: Q4_0 w = d * (q - 8) (bias -8d); Q4_1 w = d * q + m (bias
  m); Q8_0 w = d * q, q signed (code q + 128, bias -128d). Scales and biases stay float16: held at the file's size.
- Q4_K, Q5_K: super-blocks of 256, eight groups of 32 with 6-bit scales and mins under float16 d and dmin: scale d *
  sc, bias -dmin * m, float32 (products of a float16 and a 6-bit integer). Q5_K's 5-bit codes are held one a byte.
- Q6_K: super-blocks of 256, sixteen groups of 16 with int8 scales under float16 d: scale d * sc, code q (6 bits, one a
  byte), bias -32 * scale.
K-quants are held larger than in the file (Q4_K 0.75 bytes a weight against 0.56, Q5_K 1.25 against 0.69, Q6_K 1.5
against 0.82), a quarter to a third of float32."""
import numpy as np

from exo.inference.quantized import QuantizedWeight

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
GGUF_AFFINE_TYPES = tuple(BLOCK_BYTES)


def _half(b: np.ndarray) -> np.ndarray:
  """(n, 2) bytes as float16 (n,)."""
  return np.ascontiguousarray(b).view(np.float16)[:, 0]


def _k_scales(scales: np.ndarray):
  """Q4_K/Q5_K's 12 bytes of eight 6-bit scales and eight 6-bit mins per super-block."""
  d, m, low = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
  sc = np.concatenate([d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)], axis=1)
  mins = np.concatenate([m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)], axis=1)
  return sc.astype(np.float32), mins.astype(np.float32)


def _low_high(qs: np.ndarray, chunk: int) -> np.ndarray:
  """Nibbles as llama.cpp orders them: per `chunk` bytes, their low nibbles' inputs, then their high nibbles'."""
  n = qs.shape[0]
  qs = qs.reshape(n, -1, 1, chunk)
  return np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, -1)


def _codes_scales_biases(blocks: np.ndarray, type_name: str):
  """(codes (n, block inputs) uint8, scales (n, groups), biases (n, groups))."""
  n = blocks.shape[0]
  if type_name in ("Q4_0", "Q4_1", "Q8_0"):
    d = _half(blocks[:, :2])
    if type_name == "Q8_0":
      return (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d[:, None], (d * np.float16(-128))[:, None]
    bias = _half(blocks[:, 2:4]) if type_name == "Q4_1" else d * np.float16(-8)
    return _low_high(blocks[:, 4:] if type_name == "Q4_1" else blocks[:, 2:], 16), d[:, None], bias[:, None]
  if type_name == "Q6_K":
    ql, qh, sc, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _half(blocks[:, 208:210])
    low = _low_high(ql, 64)
    high = ((qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(n, -1)
    scale = d.astype(np.float32)[:, None] * sc.view(np.int8).astype(np.float32)
    return low | (high << 4), scale, scale * np.float32(-32)
  d, dmin = _half(blocks[:, :2]).astype(np.float32), _half(blocks[:, 2:4]).astype(np.float32)
  sc, mins = _k_scales(blocks[:, 4:16])
  scale, bias = d[:, None] * sc, -(dmin[:, None] * mins)
  if type_name == "Q4_K":
    return _low_high(blocks[:, 16:], 32), scale, bias
  qh, qs = blocks[:, 16:48], blocks[:, 48:]  # Q5_K: the fifth bit of input i of group g is bit g of qh[i]
  high = ((qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1).reshape(n, -1)
  return _low_high(qs, 32) | (high << 4), scale, bias


def from_gguf_blocks(data: np.ndarray, type_name: str, rows: int) -> QuantizedWeight:
  """A GGUF tensor's raw bytes (as gguf's reader maps them) of one of GGUF_AFFINE_TYPES as `rows` rows of affine
  groups: 4-bit codes for Q4_0, Q4_1 and Q4_K, 8-bit (one a byte) for the others."""
  blocks = np.asarray(data, dtype=np.uint8).reshape(-1, BLOCK_BYTES[type_name])
  codes, scales, biases = _codes_scales_biases(blocks, type_name)
  group = codes.shape[1] // scales.shape[1]
  bits = 4 if type_name in ("Q4_0", "Q4_1", "Q4_K") else 8
  if bits == 4:  # MLX's order: byte k holds inputs 2k (low nibble) and 2k + 1
    codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
  return QuantizedWeight(np.ascontiguousarray(codes.reshape(rows, -1)).view(np.uint32), scales.reshape(rows, -1),
                         biases.reshape(rows, -1), group, bits)

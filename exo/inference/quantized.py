"""MLX-format quantized matrices, as mlx-lm's converter writes them (mlx-community's checkpoints).

A quantized linear layer or embedding `P` is stored as `P.weight` (uint32, (out, in * bits / 32): `bits`-bit codes
packed little-endian, code j of a row at bit j * bits), `P.scales` ((out, in / group_size), one per group of
`group_size` inputs) and, in "affine" mode, `P.biases`: w = scale * code + bias. The "mxfp4"/"mxfp8" modes store
FP4 (E2M1) / FP8 (E4M3) codes and power-of-two (E8M0) scales, no biases. config.json's `quantization` holds the
defaults (`group_size`, `bits`, `mode`) and per-layer overrides keyed by the layer's path; a layer is quantized
exactly when its `.scales` tensor exists (mlx-lm's own rule). A mixture of experts' projections come stacked, every
expert's matrix one after another along a leading dimension (experts, out, ...), each quantized on its own."""
from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

MODES = ("affine", "mxfp4", "mxfp8")  # what dequantize() below reads; MLX itself also has nvfp4


@dataclass
class QuantizedWeight:
  packed: np.ndarray  # uint32 (out, in * bits / 32), or (stacked, out, in * bits / 32)
  scales: np.ndarray  # (out, in / group_size) likewise: float32 in "affine" mode, uint8 exponents in the mx modes
  biases: Optional[np.ndarray]
  group_size: int
  bits: int
  mode: str = "affine"

  @property
  def shape(self):
    return (*self.packed.shape[:-1], self.packed.shape[-1] * 32 // self.bits)

  @property
  def nbytes(self) -> int:
    return sum(a.nbytes for a in (self.packed, self.scales, self.biases) if a is not None)

  def __getitem__(self, index: int) -> "QuantizedWeight":
    """One matrix of a stack (an expert's, a head's): views of the stack's arrays, no copy."""
    pick = lambda a: None if a is None else a[index]
    return QuantizedWeight(pick(self.packed), pick(self.scales), pick(self.biases), self.group_size, self.bits, self.mode)

  def __len__(self) -> int:
    return self.packed.shape[0]

  def same_format(self, other: "QuantizedWeight") -> bool:
    return (self.group_size, self.bits, self.mode) == (other.group_size, other.bits, other.mode)

  def dequantize(self) -> np.ndarray:
    """The float32 (out, in) matrix (a stack's (stacked, out, in))."""
    if self.packed.ndim > 2:
      return np.stack([self[i].dequantize() for i in range(len(self))])
    out, n_in = self.shape
    codes = unpack_codes(self.packed, self.bits, n_in).reshape(out, -1, self.group_size)
    if self.mode == "affine":
      w = codes.astype(np.float32) * self.scales[..., None] + self.biases[..., None]
    elif self.mode in ("mxfp4", "mxfp8"):
      table = E2M1 if self.mode == "mxfp4" else _E4M3
      w = table[codes] * np.ldexp(np.float32(1.0), self.scales.astype(np.int32) - 127)[..., None]
    else:
      raise ValueError(f"quantization mode {self.mode!r} is not supported (only {', '.join(MODES)})")
    return np.ascontiguousarray(w.reshape(out, n_in), dtype=np.float32)


def stack_rows(parts, new_axis: bool = False) -> QuantizedWeight:
  """Matrices quantized alike, one above the other (rows are quantized independently): fused q/k/v, gate/up; with
  `new_axis`, as a stack of matrices (experts, out, ...)."""
  join = lambda arrays: None if arrays[0] is None else (np.stack if new_axis else np.concatenate)(arrays)
  first = parts[0]
  return QuantizedWeight(join([p.packed for p in parts]), join([p.scales for p in parts]), join([p.biases for p in parts]),
                         first.group_size, first.bits, first.mode)


def unpack_codes(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
  """(rows, n) integer codes from rows of packed uint32 words."""
  if 32 % bits == 0:  # 2, 4, 8 bits: whole codes per word
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    return ((packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(packed.shape[0], -1)[:, :n]
  # 3, 5, 6 bits: codes run across word boundaries; read each row as one little-endian bit stream
  stream = np.unpackbits(np.ascontiguousarray(packed).view(np.uint8), axis=-1, bitorder="little")
  stream = stream[:, :n * bits].reshape(packed.shape[0], n, bits).astype(np.uint32)
  return (stream << np.arange(bits, dtype=np.uint32)).sum(-1, dtype=np.uint32)


def _e4m3_table() -> np.ndarray:
  codes = np.arange(256)
  sign = np.where(codes & 0x80, -1.0, 1.0)
  exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
  value = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
  value = np.where((exponent == 0xF) & (mantissa == 0x7), np.nan, value)
  return (sign * value).astype(np.float32)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
_E4M3 = _e4m3_table()


def group_mxfp4_blocks(tensors: Dict[str, object]) -> Dict[str, object]:
  """gpt-oss's own MXFP4 experts, as OpenAI's repositories store them (`quantization_config.quant_method` "mxfp4"):
  `P_blocks`, uint8 (..., out, in / 32, 16), two E2M1 codes a byte, the lower input in the low nibble, and `P_scales`,
  uint8 (..., out, in / 32), an E8M0 exponent (2 ** (e - 127)) a block of 32 inputs. Those are MLX's "mxfp4" mode
  in groups of 32, byte for byte: each pair becomes one QuantizedWeight under `P.weight`, no copy."""
  out = dict(tensors)
  for name in [n for n in tensors if n.endswith("_blocks")]:
    layer = name[:-len("_blocks")]
    blocks, scales = out.pop(name), out.pop(f"{layer}_scales", None)
    if scales is None or blocks.shape[:-1] != scales.shape or blocks.shape[-1] % 4:
      raise ValueError(f"{layer}: MXFP4 blocks {blocks.shape} without matching scales {None if scales is None else scales.shape}")
    packed = np.ascontiguousarray(blocks).reshape(*blocks.shape[:-2], -1).view(np.uint32)
    out[f"{layer}.weight"] = QuantizedWeight(packed, np.ascontiguousarray(scales), None, blocks.shape[-1] * 2, 4, "mxfp4")
  return out


def layer_format(quantization: dict, layer: str) -> dict:
  """group_size, bits and mode for one layer path (e.g. "model.layers.0.mlp.down_proj"), overrides applied."""
  base = {"group_size": 64, "bits": 4, "mode": "affine"}
  base.update({k: quantization[k] for k in base if k in quantization})
  override = quantization.get(layer)
  if isinstance(override, dict):
    base.update({k: override[k] for k in base if k in override})
  return base


def group_quantized(tensors: Dict[str, np.ndarray], quantization: Optional[dict]) -> Dict[str, object]:
  """Replace each `P.weight`/`P.scales`/`P.biases` triple by one QuantizedWeight under `P.weight`."""
  out = dict(tensors)
  for name in [n for n in tensors if n.endswith(".scales")]:
    layer = name[:-len(".scales")]
    fmt = layer_format(quantization or {}, layer)
    packed = out.pop(f"{layer}.weight", None)
    if packed is None:
      raise ValueError(f"{layer}: scales without a packed weight")
    q = QuantizedWeight(packed.view(np.uint32), out.pop(name), out.pop(f"{layer}.biases", None), fmt["group_size"], fmt["bits"], fmt["mode"])
    if q.mode == "affine" and q.biases is None:
      raise ValueError(f"{layer}: affine quantization without biases")
    if q.shape[-1] != q.scales.shape[-1] * q.group_size:
      raise ValueError(f"{layer}: {q.packed.shape} packed at {q.bits} bits does not fit scales {q.scales.shape} with group size {q.group_size}")
    out[f"{layer}.weight"] = q
  return out



def take_rows(w: QuantizedWeight, index: np.ndarray) -> QuantizedWeight:
  """The matrix with its rows in the order `index` gives (rows are quantized independently, so they move whole)."""
  pick = lambda a: None if a is None else np.ascontiguousarray(a[index])
  return QuantizedWeight(pick(w.packed), pick(w.scales), pick(w.biases), w.group_size, w.bits, w.mode)

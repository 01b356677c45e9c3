"""A quantized weight as the numpy engine keeps it: packed codes, 16-bit scales and biases, products by qkernels.py.

Rows are the matrix's outputs, as checkpoints store them; a product's output columns a..b are rows a..b here, so the
engine's column slices (kernels.py) are slices of rows. Up to DIRECT_ROWS input rows a product reads the codes
directly (a decode step, bound by reading the weights); above, it turns TILE weight rows at a time into float32 and
lets BLAS multiply them (prefill, big batches: bound by arithmetic, where BLAS is several times faster than the
direct kernel and the dequantising is paid once for all rows)."""
from typing import Optional

import numpy as np

from exo.inference.numpy import qkernels
from exo.inference.quantized import QuantizedWeight

DIRECT_ROWS = 2
TILE = 256
_ready = set()  # (bits, table) whose kernels this process has compiled or read from numba's cache


def _half_bits(values: np.ndarray) -> tuple:
  """Scales or biases as the kernels read them, (array, table name): float16 as their bits; float32 values that are
  bfloat16 ones (the safetensors reader widens those) as bfloat16 bits; other float32 values as they are."""
  if values.dtype == np.float16:
    return values.view(np.uint16), "float16"
  values = np.ascontiguousarray(values, dtype=np.float32)
  as_bits = values.view(np.uint32)
  if not (as_bits & 0xFFFF).any():
    return (as_bits >> 16).astype(np.uint16), "bfloat16"
  return values, "float32"


class PackedMatrix:
  """An (out, in) matrix of 4- or 8-bit codes in groups along its inputs, each group with a scale and a bias."""

  def __init__(self, codes: np.ndarray, scales: np.ndarray, biases: np.ndarray, table: str, bits: int):
    self.codes, self.scales, self.biases, self.table_name, self.bits = codes, scales, biases, table, bits
    self.table = qkernels.TABLES[table]
    self._product = qkernels.product_rows_4 if bits == 4 else qkernels.product_rows_8

  @classmethod
  def supports(cls, w: QuantizedWeight) -> bool:
    return w.mode == "affine" and w.bits in (4, 8) and (w.shape[1] // w.scales.shape[1]) % 2 == 0

  @classmethod
  def from_quantized(cls, w: QuantizedWeight) -> "PackedMatrix":
    scales, table = _half_bits(w.scales)
    biases, bias_table = _half_bits(w.biases)
    if bias_table != table:  # one table reads both
      scales, biases, table = w.scales.astype(np.float32), w.biases.astype(np.float32), "float32"
    codes = np.ascontiguousarray(w.packed).view(np.uint8)
    matrix = cls(codes, np.ascontiguousarray(scales), np.ascontiguousarray(biases), table, w.bits)
    if (w.bits, table) not in _ready:  # at load, not in a request's first step: reading the cached code takes ~1 s
      for rows in (1, DIRECT_ROWS + 1):
        matrix.product(np.zeros((rows, matrix.shape[1]), dtype=np.float32), 0, 1)
      matrix.rows(np.zeros(1, dtype=np.int64))
      matrix.rows(np.zeros(1, dtype=np.int64), halves=True)
      _ready.add((w.bits, table))
    return matrix

  @property
  def shape(self):
    return self.codes.shape[0], self.codes.shape[1] * 8 // self.bits

  @property
  def nbytes(self) -> int:
    return self.codes.nbytes + self.scales.nbytes + self.biases.nbytes

  def take_rows(self, index: np.ndarray) -> "PackedMatrix":
    pick = lambda a: np.ascontiguousarray(a[index])
    return PackedMatrix(pick(self.codes), pick(self.scales), pick(self.biases), self.table_name, self.bits)

  def rows(self, ids: np.ndarray, out: Optional[np.ndarray] = None, halves: bool = False) -> np.ndarray:
    """Rows `ids` as float32 (len(ids), in): embedding lookups; with `halves`, 4-bit rows' even inputs then their odd
    ones (see qkernels.dequantize_rows)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if out is None:
      out = np.empty((len(ids), self.shape[1]), dtype=np.float32)
    if halves and self.bits == 4:
      qkernels.dequantize_halves_4(self.codes, self.scales, self.biases, self.table, ids, out)
    else:
      qkernels.dequantize_rows(self.codes, self.scales, self.biases, self.table, self.bits, ids, out)
    return out

  def product(self, x: np.ndarray, a: int, b: int) -> np.ndarray:
    """x (rows, in) @ this matrix's rows a..b, transposed: (rows, b - a) float32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], b - a), dtype=np.float32)
    if x.shape[0] <= DIRECT_ROWS:
      self._product(x, self.codes, self.scales, self.biases, self.table, a, b, out)
      return out
    halves = self.bits == 4
    if halves:  # the inputs in the order the tiles are written in
      x = np.concatenate((x[:, 0::2], x[:, 1::2]), axis=1)
    tile = np.empty((min(TILE, b - a), x.shape[1]), dtype=np.float32)
    for lo in range(a, b, TILE):
      hi = min(b, lo + TILE)
      w = self.rows(np.arange(lo, hi), tile[:hi - lo], halves)
      np.matmul(x, w.T, out=out[:, lo - a:hi - a])
    return out

  def dequantize(self) -> np.ndarray:
    return self.rows(np.arange(self.shape[0]))

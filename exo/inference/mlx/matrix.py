"""Weight matrices as the MLX model runs them: float, or MLX-quantized and kept so.

Quantized checkpoints stay quantized in memory and run through mx.quantized_matmul, as mlx-lm runs them. On a GPU
the model computes in the checkpoint's own precision (bf16/fp16); on the CPU in float32, where MLX's kernels are
fastest. MLX's CPU quantized matmul has no BLAS behind it and its cost grows with every row (about 3x a float32
matmul for one row, 30-40x at 16): for steps of more than QMM_MAX_ROWS rows (prefill, big batches) the CPU
dequantises each matrix just for that product and uses BLAS, which keeps memory at the quantized size. (SmolLM2 4-bit,
one step: quantized matmul 0.6x the time of dequantise+BLAS at 4 rows, 1.4x at 8.)"""
from typing import List

import mlx.core as mx

import numpy as np

from exo.inference.quantized import QuantizedWeight, stack_rows
from exo.inference.weights import LlamaConfig

QMM_MAX_ROWS = 6
GROUP_SIZES = (32, 64, 128)  # what MLX's quantized kernels take; other groups (GGUF's Q6_K: 16) are dequantised
ON_GPU = mx.default_device().type == mx.DeviceType.gpu


def compute_dtype(config: LlamaConfig) -> mx.Dtype:
  if not ON_GPU:
    return mx.float32
  return {"bfloat16": mx.bfloat16, "float16": mx.float16}.get(config.dtype, mx.float32)


class Matrix:
  """An (out, in) weight for x @ W.T and row lookups: float, or MLX-quantized (packed codes, scales, biases). A stack
  of them (heads, out, in) multiplies a stack of inputs (heads, rows, in), each by its own."""

  def __init__(self, w, dtype: mx.Dtype):
    self.dtype = dtype
    if isinstance(w, QuantizedWeight) and w.group_size not in GROUP_SIZES:
      w = w.dequantize()
    if isinstance(w, QuantizedWeight):
      self.weight = mx.array(w.packed)
      # affine scales and biases take the compute dtype; the mx modes' scales are uint8 exponents, kept as stored
      self.scales = mx.array(w.scales).astype(dtype) if w.mode == "affine" else mx.array(w.scales)
      self.biases = None if w.biases is None else mx.array(w.biases).astype(dtype)
      self.format = {"group_size": w.group_size, "bits": w.bits, **({"mode": w.mode} if w.mode != "affine" else {})}
    else:
      self.weight, self.scales, self.biases = mx.array(w).astype(dtype), None, None

  def arrays(self) -> List[mx.array]:
    return [a for a in (self.weight, self.scales, self.biases) if a is not None]

  def _dense(self, weight, scales, biases) -> mx.array:
    return mx.dequantize(weight, scales, biases, **self.format).astype(self.dtype)

  def __call__(self, x: mx.array) -> mx.array:
    if self.scales is None:
      return x @ mx.swapaxes(self.weight, -1, -2)  # (out, in) kept as stored: a transposed BLAS call, no copy
    if not ON_GPU and x.shape[-2] > QMM_MAX_ROWS:
      return x @ mx.swapaxes(self._dense(self.weight, self.scales, self.biases), -1, -2)
    return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True, **self.format)

  def rows(self, ids: mx.array) -> mx.array:
    if self.scales is None:
      return self.weight[ids]
    return self._dense(self.weight[ids], self.scales[ids], None if self.biases is None else self.biases[ids])


class Stacked:
  """Matrices quantized differently (mlx-lm's per-layer overrides), side by side: their outputs concatenated."""

  def __init__(self, matrices: List[Matrix]):
    self.matrices = matrices

  def arrays(self) -> List[mx.array]:
    return [a for m in self.matrices for a in m.arrays()]

  def __call__(self, x: mx.array) -> mx.array:
    return mx.concatenate([m(x) for m in self.matrices], axis=-1)


class Experts:
  """One projection of every expert of a layer, stacked, for rows that each go through their chosen experts:
  mx.gather_qmm over the experts' quantized matrices where all are quantized alike (as mlx-lm runs them), else
  mx.gather_mm over float (experts, in, out)."""

  def __init__(self, matrices: list, dtype: mx.Dtype):
    if all(isinstance(m, QuantizedWeight) and m.same_format(matrices[0]) and m.group_size in GROUP_SIZES for m in matrices):
      self.quantized = Matrix(stack_rows(matrices, new_axis=True), dtype)
      self.weight = None
    else:
      self.quantized = None
      self.weight = mx.array(np.stack([(m.dequantize() if isinstance(m, QuantizedWeight) else m).T for m in matrices])).astype(dtype)

  def arrays(self) -> List[mx.array]:
    return self.quantized.arrays() if self.quantized is not None else [self.weight]

  def __call__(self, x: mx.array, chosen: mx.array) -> mx.array:
    """x (rows, 1, 1, in) times each row's chosen experts' matrices (rows, k): (rows, k, 1, out)."""
    if self.weight is not None:
      return mx.gather_mm(x, self.weight, rhs_indices=chosen)
    q = self.quantized
    return mx.gather_qmm(x, q.weight, q.scales, q.biases, rhs_indices=chosen, transpose=True, **q.format)


def matrix(w, dtype: mx.Dtype):
  """A layout weight as the model runs it; a tuple (parts that could not be fused) runs side by side."""
  return Stacked([Matrix(p, dtype) for p in w]) if isinstance(w, tuple) else Matrix(w, dtype)

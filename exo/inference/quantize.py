"""Float checkpoints quantized as they load (`--quantize 8|4`, EXO_QUANTIZE), into the affine form mlx-lm's converter
writes (quantized.py's QuantizedWeight): per group of GROUP_SIZE inputs of a row, w = scale * code + bias, codes of 4
or 8 bits, scale and bias float16. The numpy and MLX engines then hold and run the matrices packed.

Which matrices: the ones every token's step multiplies by, as mlx-lm quantizes its Linear, Embedding and
SwitchLinear layers: the layers' projections, a mixture of experts' expert and shared-expert matrices (one matrix an
expert, or every expert's stacked (experts, out, in), each expert quantized on its own), the token embedding and the
output head (a tied head is the quantized embedding). Norms, biases and routers stay float (a router picks the
experts: mlx-lm keeps it float too), as do gpt-oss's experts in transformers' (experts, in, out) layout, whose
checkpoints ship them in MXFP4 already. A matrix whose inputs are no multiple of 32 stays float.

Each matrix is quantized as soon as it is read, so a load holds the quantized model and one float matrix, never the
float model; and in row blocks, so a large embedding's temporaries stay small."""
import re
from typing import Optional

import numpy as np

from exo.inference.quantized import QuantizedWeight, stack_rows

BITS = (4, 8)
GROUP_SIZES = (64, 32)  # mlx-lm's default, then the smaller one for matrices whose inputs 64 does not divide
BLOCK_VALUES = 1 << 22  # floats quantized at a time (16 MiB of float32)
# projections (q_proj..., gate_proj...), and experts' matrices under any family's names: Mixtral's
# block_sparse_moe.experts.<e>.w1, DeepSeek's and Qwen's mlp.experts.<e>.gate_proj and mlp.shared_expert(s).*, mlx-lm's
# mlp.switch_mlp.gate_proj (stacked); never a router (mlp.gate, block_sparse_moe.gate, mlp.router)
_QUANTIZED_NAMES = re.compile(r"(model\.embed_tokens|lm_head|model\.layers\.\d+\.(self_attn\.\w+_proj|(mlp|block_sparse_moe)\."
                              r"(\w+_proj|(experts\.\d+|experts|shared_experts?|switch_mlp)\.\w+)))\.weight$")


def parse_bits(raw, name: str) -> Optional[int]:
  """A --quantize / EXO_QUANTIZE value as bits (None: off, for unset, empty, 0 or "off"); ValueError naming `name`."""
  text = "" if raw is None else str(raw).strip().lower()
  if text in ("", "0", "off", "none"):
    return None
  if text in ("4", "8"):
    return int(text)
  raise ValueError(f"{name} must be 8 or 4 (bits a weight is kept in), or 0 for off, got {raw!r}")


def quantizes(name: str, shape) -> bool:
  """Whether a float tensor (Hugging Face name and shape: a matrix, or a stack of experts' matrices) is quantized on
  load."""
  return len(shape) in (2, 3) and _QUANTIZED_NAMES.match(name) is not None and group_size(shape[-1]) is not None


def group_size(inputs: int) -> Optional[int]:
  return next((g for g in GROUP_SIZES if inputs % g == 0), None)


def quantize(w: np.ndarray, bits: int) -> QuantizedWeight:
  """An (out, in) float matrix as `bits`-bit affine groups: each group's range split into 2**bits - 1 steps, its
  minimum the bias; codes are rounded against the float16 scale and bias actually stored. A stack of experts'
  matrices (experts, out, in) comes back a stack, each expert quantized on its own."""
  if w.ndim == 3:
    return stack_rows([quantize(matrix, bits) for matrix in w], new_axis=True)
  rows, inputs = w.shape
  group = group_size(inputs)
  if bits not in BITS or group is None:
    raise ValueError(f"cannot quantize a matrix of {inputs} inputs to {bits} bits")
  levels = (1 << bits) - 1
  groups = inputs // group
  codes = np.empty((rows, inputs), dtype=np.uint8)
  scales = np.empty((rows, groups), dtype=np.float16)
  biases = np.empty((rows, groups), dtype=np.float16)
  step = max(1, BLOCK_VALUES // inputs)
  for a in range(0, rows, step):
    b = min(rows, a + step)
    block = np.asarray(w[a:b], dtype=np.float32).reshape(b - a, groups, group)
    low, high = block.min(axis=-1), block.max(axis=-1)
    bias = low.astype(np.float16)
    scale = ((high - bias.astype(np.float32)) / levels).astype(np.float16)
    if not (np.isfinite(bias).all() and np.isfinite(scale).all()):
      raise ValueError(f"weights beyond float16's range ({low.min():g} to {high.max():g}) cannot be quantized here")
    divisor = np.where(scale > 0, scale, 1).astype(np.float32)[..., None]  # a constant group: every code 0, exact
    q = block - bias.astype(np.float32)[..., None]
    q /= divisor
    np.rint(q, out=q)
    np.clip(q, 0, levels, out=q)
    codes[a:b] = q.reshape(b - a, inputs)
    scales[a:b], biases[a:b] = scale, bias
  if bits == 4:  # MLX's order: byte k holds inputs 2k (low nibble) and 2k + 1
    codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
  return QuantizedWeight(np.ascontiguousarray(codes).view(np.uint32), scales, biases, group, bits)


def held_bytes(bits: int, group: int = GROUP_SIZES[0]) -> float:
  """Bytes a weight takes quantized this way: its code, and its share of the group's 16-bit scale and bias."""
  return bits / 8 + 4 / group

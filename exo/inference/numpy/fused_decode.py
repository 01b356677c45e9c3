"""A decode step's layers in one compiled call (kernels_c/decoder.c), for the plain dense decoder with quantized weights.

A one-row step through llama.py's layers is ~7 products and a dozen small numpy operations a layer, each a Python
call (and, shared among OpenMP's threads, a fork and join a product): for SmolLM2 about a fifth of the step's time
went to that, not to arithmetic. Here every layer of the step runs in C, in one OpenMP parallel region when the step
is shared (packed.SharedDecode chooses, as for the direct products), with a barrier between phases.

It covers what a plain Llama-style layer holds: both input norms, q/k/v (with or without biases), RoPE over whole
heads, a float32 cache that every query sees whole, softmax attention, the output product (with or without a bias),
SiLU-gated MLP; every matrix kept quantized for the compiled kernels. A model with anything more (query/key norms,
post norms, sliding windows, softcaps, sinks, experts, latent attention, GELU, residual scaling, a float16 cache,
float weights) is told apart once, as it is built (`FusedDecode.build` answers None), and runs llama.py's layers. A
step runs here only when every row is one new position of its request, there are at most DIRECT_ROWS of them, and
either the step is shared or it has one row (unshared, llama.py shares a multi-row step's products among the
engine's worker threads; this runs on one core)."""
import ctypes
from typing import List, Optional

import numpy as np

from exo.inference.numpy import native, packed
from exo.inference.numpy.attention import Step
from exo.inference.numpy.kernels import PARALLEL_ROWS
from exo.inference.numpy.packed import DIRECT_ROWS, PackedMatrix

_lib = native.library()
PANEL = 64  # decoder.c's: gate/up's outputs a task, one pair of llama.PAIR gate and PAIR up outputs
MATRICES = ("qkv", "o", "gate_up", "down")
PLAIN_PARTS = set(MATRICES) | {"attn_norm", "mlp_norm", "qkv_bias", "o_bias"}  # a layer's parts the fused pass computes


class DecoderLayer(ctypes.Structure):
  """decoder.c's decoder_layer"""
  _fields_ = [(name, native.Matrix) for name in MATRICES] + [(name, ctypes.c_void_p) for name in ("attn_norm", "mlp_norm", "qkv_bias", "o_bias")]


class DecoderShape(ctypes.Structure):
  """decoder.c's decoder_shape"""
  _fields_ = [(name, ctypes.c_int64) for name in ("n_layers", "hidden", "n_heads", "n_kv", "head_dim", "inter", "positions")] + \
             [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


def _covers(model) -> bool:
  """Whether every layer of the model is one the fused pass computes exactly as llama.py does."""
  c, pool = model.config, model.pool
  if _lib is None or not model.layers or c.latent_attention or c.activation != "silu" or c.qk_norm is not None:
    return False
  if c.residual_scale != 1.0 or c.attn_softcap is not None or any(c.slides(layer) for layer in model.layer_ids):
    return False
  if pool.dtype != np.float32 or pool.slot_shape[1] != 2 or len(model.rope_tables) != 1 or 2 * len(model.rope_tables[0]) != c.head_dim:
    return False
  if c.n_heads % c.n_kv_heads or (2 * c.intermediate_size) % PANEL:
    return False
  for layer in model.layers:
    if any(value is not None for name, value in layer.items() if name not in PLAIN_PARTS):
      return False
    if layer["attn_norm"] is None or layer["mlp_norm"] is None:
      return False
    if not all(isinstance(layer[name], PackedMatrix) and layer[name]._kernel is not None for name in MATRICES):
      return False
  return True


class FusedDecode:
  def __init__(self, model):
    c = model.config
    as_float = lambda a: None if a is None else np.ascontiguousarray(a, dtype=np.float32)
    self.keep: List[np.ndarray] = []  # the arrays the C structures point into

    def address(a) -> Optional[int]:
      a = as_float(a)
      if a is None:
        return None
      self.keep.append(a)
      return a.ctypes.data
    self.layers = (DecoderLayer * len(model.layers))()
    for described, layer in zip(self.layers, model.layers):
      for name in MATRICES:
        setattr(described, name, layer[name]._description)
        self.keep.append(layer[name])
      for name in ("attn_norm", "mlp_norm", "qkv_bias", "o_bias"):
        setattr(described, name, address(layer[name]))
    scale = c.attention_scale if c.attention_scale is not None else 1.0 / np.sqrt(c.head_dim)
    self.shape = DecoderShape(len(model.layers), c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate_size,
                              model.pool.positions, c.rms_norm_eps, np.float32(scale))
    self.inv_freq = model.rope_tables[0]
    self._layers, self._shape = ctypes.addressof(self.layers), ctypes.addressof(self.shape)

  @classmethod
  def build(cls, model) -> Optional["FusedDecode"]:
    """The fused pass for `model` (a llama.Llama), or None where it does not cover the model."""
    return cls(model) if _covers(model) else None

  @staticmethod
  def takes(step: Step) -> bool:
    """Whether this step runs here: decode rows only, few enough, and shared or one row (see the module's doc)."""
    rows = step.rows
    if rows > DIRECT_ROWS or rows != len(step.layout.lengths):
      return False
    return rows < PARALLEL_ROWS or packed._shares()

  def run(self, h: np.ndarray, step: Step) -> np.ndarray:
    """h (rows, hidden) float32 through every layer, in place; the rows' keys and values written to their caches."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    rows = step.rows
    slots = np.empty(rows, dtype=np.uintp)
    for slab, row_range, slot_index, _ in step.writes:
      slots[row_range] = slab.ctypes.data + slot_index.astype(np.uintp) * slab.strides[0]
    positions = np.ascontiguousarray(step.positions, dtype=np.int64)
    cos, sin = step.layout.angles(self.inv_freq)  # (rows, 1, head_dim // 2), contiguous: rows of head_dim // 2
    if _lib.decode_layers(self._layers, self._shape, h.ctypes.data, rows, slots.ctypes.data, positions.ctypes.data,
                          cos.ctypes.data, sin.ctypes.data, packed._shares()):
      raise MemoryError("no memory for a decode step's buffers")
    return h

"""A decode step in one compiled call (kernels_c/decoder.c), for the plain dense decoder with quantized weights.

Through llama.py's layers a decode step is ~7 products and a dozen small numpy operations a layer, each a Python call
(and, when shared, a fork and join a product): for SmolLM2 a fifth of a one-row step. Here every layer runs in C, in
one OpenMP parallel region when the step is shared (packed.SharedDecode chooses), each phase's tasks done before the
next (decoder.c's `phase`: a thread waits for the tasks, not for a descheduled thread to reach a barrier).

It covers a plain Llama-style layer: both input norms, q/k/v (biases or not), RoPE over whole heads, a float32 cache
every query sees whole, softmax attention, the output product (bias or not), the SiLU-gated MLP, every matrix
quantized. A model with anything more (query/key norms, post norms, sliding windows, softcaps, sinks, experts, latent
attention, GELU, residual scaling, a float16 cache, float weights) is told apart as it is built (`build` answers None)
and runs llama.py's layers. A step runs here when every row is one new position of its request, there are at most
MOST_ROWS of them, and the step is shared, or has one row, or the machine has one core (llama.py's layers would run
there with Python between the products: 1.2x this pass's CPU time at 16 rows). Up to packed.DIRECT_ROWS rows the
products read the codes directly; more take the panel kernel (kernels_c/panels.c), by tasks of whole panels.

Where the shard's ends are quantized too, the step is taken whole (`step`): the embedding lookup, the layers, the final
norm and the head's product (SmolLM2's tied 8-bit head is a third of the weights a token reads) in the same call, with
none of the bookkeeping (Step) the layers' path needs. Otherwise only the layers run here (`run`)."""
import ctypes
from typing import List, Optional, Sequence

import numpy as np

from exo.inference.llama_layout import rope_angles, step_input
from exo.inference.numpy import kernels, native, packed
from exo.inference.numpy.attention import Step, finish_logits
from exo.inference.numpy.cache import KVCache
from exo.inference.numpy.kernels import PARALLEL_ROWS, weight_rows
from exo.inference.numpy.packed import PANEL_ROWS, PackedMatrix

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


class DecoderEnds(ctypes.Structure):
  """decoder.c's decoder_ends"""
  _fields_ = [("embed", ctypes.c_void_p), ("head", ctypes.c_void_p), ("norm", ctypes.c_void_p), ("embed_scale", ctypes.c_float)]


def _compiled(w) -> Optional[int]:
  """A weight's address for the kernels (native.Matrix), or None where they do not read it (float weights)."""
  return w._kernel if isinstance(w, PackedMatrix) else None


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
  def __init__(self, model, whole_steps: bool = True):
    """`whole_steps`: take a step whole (`step`) where the shard's ends allow; False leaves the ends to llama.py."""
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

    # the ends: the embedding looked up here (else by numpy before the call); the head here, or the step is not taken
    # whole. (The model itself is not held: a cycle would keep its weights after its engine lets it go.)
    self.config, self.first, self.last = c, model.shard.is_first_layer(), model.head is not None
    self.embedding = (model.embed if model.embed is not None else model.head) if self.first else None
    embedding = self.embedding
    self.embeds = _compiled(embedding) is not None
    self.whole = whole_steps and (not self.last or _compiled(model.head) is not None)
    self.ends = DecoderEnds(_compiled(embedding) if self.embeds else None, _compiled(model.head) if self.last else None,
                            address(model.norm) if self.last else None, np.float32(c.embedding_scale))
    self.keep.append(model.head)
    self._ends = ctypes.addressof(self.ends)

  @classmethod
  def build(cls, model) -> Optional["FusedDecode"]:
    """The fused pass for `model` (a llama.Llama), or None where it does not cover the model."""
    return cls(model) if _covers(model) else None

  MOST_ROWS = PANEL_ROWS  # decode rows a step here takes at most: up to DIRECT_ROWS by the direct kernel, then the panels

  @classmethod
  def takes_rows(cls, rows: int) -> bool:
    """Whether `rows` decode rows are few enough for this pass, and shared or one, or the machine has one core (see
    the module's doc)."""
    return rows <= cls.MOST_ROWS and (rows < PARALLEL_ROWS or packed._shares() or kernels.CORES == 1)

  @classmethod
  def takes(cls, step: Step) -> bool:
    """Whether this step's layers run here: decode rows only, few enough, and shared or one row."""
    return step.rows == len(step.layout.lengths) and cls.takes_rows(step.rows)

  def run(self, h: np.ndarray, step: Step) -> np.ndarray:
    """h (rows, hidden) float32 through every layer, in place; the rows' keys and values written to their caches."""
    h = np.ascontiguousarray(h, dtype=np.float32)
    rows = step.rows
    slots = np.empty(rows, dtype=np.uintp)
    for slab, row_range, slot_index, _ in step.writes:
      slots[row_range] = slab.ctypes.data + slot_index.astype(np.uintp) * slab.strides[0]
    self._call(None, h, None, step.positions, slots)
    return h

  def step(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> Optional[List[np.ndarray]]:
    """llama.Llama.forward's answer for a step this pass takes whole (one new position a request, few enough
    requests, the shard's head, if it has one, compiled): one call from token ids or hidden states to logits or
    hidden states, the caches advanced. None, touching nothing, for any other step."""
    rows = len(inputs)
    if not self.whole or not rows or not self.takes_rows(rows) or any(len(x) != 1 for x in inputs):
      return None
    c = self.config
    positions = np.array([cache.length for cache in caches], dtype=np.int64)
    if positions.max() + 1 > caches[0].capacity:
      raise ValueError(f"a request of {positions.max() + 1} positions exceeds the context of {caches[0].capacity}")
    slots = np.array([cache.address for cache in caches], dtype=np.uintp)
    ids = None
    if self.first and self.embeds:
      ids = step_input(inputs, True, c.hidden_size)
      h = np.empty((rows, c.hidden_size), dtype=np.float32)
    elif self.first:
      h = weight_rows(self.embedding, step_input(inputs, True, c.hidden_size))
      if c.embedding_scale != 1.0:
        h *= np.float32(c.embedding_scale)
    else:
      h = step_input(inputs, False, c.hidden_size)  # (a copy: the layers write it in place)
    logits = np.empty((rows, c.vocab_size), dtype=np.float32) if self.last else None
    self._call(ids, h, logits, positions, slots)
    for cache in caches:
      cache.advance(1)
    if not self.last:
      return [h[i:i + 1] for i in range(rows)]
    finish_logits(logits, c)
    return [logits[i:i + 1] for i in range(rows)]

  def _call(self, ids: Optional[np.ndarray], h: np.ndarray, logits: Optional[np.ndarray], positions: np.ndarray, slots: np.ndarray) -> None:
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    cos, sin = rope_angles(positions, self.inv_freq)  # (rows, 1, head_dim // 2), contiguous: rows of head_dim // 2
    status = _lib.decode_step(self._layers, self._shape, self._ends, None if ids is None else ids.ctypes.data, h.ctypes.data,
                              None if logits is None else logits.ctypes.data, len(h), slots.ctypes.data, positions.ctypes.data,
                              cos.ctypes.data, sin.ctypes.data, packed._shares(), len(h) > packed.DIRECT_ROWS)
    if status == -2:
      raise IndexError(f"row ids out of range 0..{self.embedding.shape[0] - 1}")
    if status:
      raise MemoryError("no memory for a decode step's buffers")

"""Decode rows' attention over a float32 KV cache, compiled (kernels_c/cache.c): one call for a run of requests in
consecutive slots (attention.DecodeRun), each row over its own positions.

A decode row's attention is a few small products per query head; numpy spent more on setting each one up than on
computing it (SmolLM2, one stream: 88 us a layer, about a fifth of the step once the products were shared among the
cores). Here a row's scores, their softmax (shifted by the row's largest score, so no exp overflows) and the sum
of the values run in one pass over its cache. `available()` is False without the compiled kernels: the caller then
takes numpy's path."""
import numpy as np

from exo.inference.numpy import native

_lib = native.library()


def available() -> bool:
  return _lib is not None


def attend_decode(slab: np.ndarray, slot: int, li: int, q: np.ndarray, first: int, ends: np.ndarray, window: int, softcap: float,
                  sinks: np.ndarray, attn: np.ndarray) -> None:
  """attn[first + r] = the attention of query row first + r (q: (rows, heads, head dim), scaled) over positions
  [ends[r] - window (0 where window is 0), ends[r]) of slab slot slot + r, layer li. softcap > 0: scores become
  softcap * tanh(score / softcap); sinks (one logit per query head, or none) join each softmax's denominator."""
  if (slab.dtype != np.float32 or q.dtype != np.float32 or attn.dtype != np.float32 or slab.ndim != 6 or q.ndim != 3 or attn.ndim != 2
          or not (slab.flags.aligned and q.flags.aligned and attn.flags.aligned)):
    raise TypeError("attend_decode takes float32 arrays: the slab (slots, layers, planes, kv heads, positions, head dim), "
                    "q (rows, heads, head dim), attn (rows, heads * head dim)")
  ends = np.ascontiguousarray(ends, dtype=np.int64)
  sinks = np.ascontiguousarray(sinks, dtype=np.float32)
  if len(ends) and (slot < 0 or slot + len(ends) > slab.shape[0] or ends.max() > slab.shape[4] or first + len(ends) > q.shape[0]):
    raise IndexError("a decode row's slot, positions or query row lies outside the cache")
  if _lib.attend_decode(slab, slot, li, q, first, ends, window, softcap, sinks, attn):
    raise MemoryError("no memory for a decode row's scores")

"""Decode rows' attention over a float32 KV cache, compiled (numba): one call for a run of requests in consecutive
slots (attention.DecodeRun), each row over its own positions.

A decode row's attention is a few small products per query head; numpy spent more on setting each one up than on
computing it (SmolLM2, one stream: 88 us a layer, about a fifth of the step once the products were shared among the
cores). Here a row's scores, their softmax (shifted by the row's largest score, so no exp overflows) and the sum
of the values run in one pass over its cache."""
import numpy as np

from exo.inference.numpy.jit import numba


@numba.njit(nogil=True, cache=True, fastmath=True, error_model="numpy", boundscheck=False)
def attend_decode(slab, slot, li, q, first, ends, window, softcap, sinks, attn):
  """attn[first + r] = the attention of query row first + r (q: (rows, heads, head dim), scaled) over positions
  [ends[r] - window (0 where window is 0), ends[r]) of slab slot slot + r, layer li. softcap > 0: scores become
  softcap * tanh(score / softcap); sinks (one logit per query head, or none) join each softmax's denominator."""
  n_heads, head_dim = q.shape[1], q.shape[2]
  group = n_heads // slab.shape[3]
  values_plane = slab.shape[2] - 1  # a slot of one plane (latent attention) holds keys that are their own values
  scores = np.empty(ends.max(), dtype=np.float32)
  out = np.empty(head_dim, dtype=np.float32)
  for r in range(ends.shape[0]):
    end = ends[r]
    start = max(0, end - window) if window > 0 else 0
    for h in range(n_heads):
      keys, values, query = slab[slot + r, li, 0, h // group], slab[slot + r, li, values_plane, h // group], q[first + r, h]
      top = np.float32(-np.inf) if sinks.shape[0] == 0 else sinks[h]
      for p in range(start, end):
        key = keys[p]
        s = np.float32(0.0)
        for d in range(head_dim):
          s += key[d] * query[d]
        if softcap > 0:
          s = softcap * np.tanh(s / softcap)
        scores[p - start] = s
        top = max(top, s)
      total = np.float32(0.0) if sinks.shape[0] == 0 else np.exp(sinks[h] - top)
      out[:] = 0.0
      for p in range(start, end):
        weight = np.exp(scores[p - start] - top)
        total += weight
        value = values[p]
        for d in range(head_dim):
          out[d] += weight * value[d]
      row = attn[first + r]
      for d in range(head_dim):
        row[h * head_dim + d] = out[d] / total

"""Llama in numpy, float32: one step runs many requests at once.

Token-parallel work (projections, MLP, norms, head) runs on all rows of all requests together; attention
runs per request against that request's own KV cache ("selective batching"). The cores share a big step by
requests, each running every layer for its own (`balanced_groups`), and a smaller one by each product's columns.

Weights are stored in column blocks, (out / BLOCK, in, BLOCK), and multiplied a few rows at a time: each
block product is then small enough for OpenBLAS's small-matrix kernel, which reads the weights as they lie.
A plain (rows, in) @ (in, out) product would first copy ("pack") the whole weight matrix, which for a
decode batch of 2-32 rows costs more than the arithmetic; this way 16 decode rows cost about twice one."""
import math
import mmap
import os
import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from exo.inference.shard import Shard
from exo.inference.weights import LlamaConfig, rope_inv_freq

BLOCK = 32  # output columns per weight block
SMALL_GEMM = 1_000_000  # OpenBLAS takes its no-packing kernel while rows * BLOCK * in stays within this


def block_weight(w: np.ndarray) -> np.ndarray:
  """(in, out) -> (out / BLOCK, in, BLOCK), contiguous; out is padded with zero columns to a whole block."""
  n_in, n_out = w.shape
  padded = -n_out % BLOCK
  if padded:
    w = np.concatenate([w, np.zeros((n_in, padded), dtype=w.dtype)], axis=1)
  return np.ascontiguousarray(w.reshape(n_in, -1, BLOCK).transpose(1, 0, 2), dtype=np.float32)


class _Worker:
  """A thread that runs one part of a product when handed one. A pair of locks hands it over: waking a thread costs
  about 25 us on this VM, and a thread pool's futures and queues cost as much again on top."""

  def __init__(self):
    self.go, self.done = threading.Lock(), threading.Lock()
    self.go.acquire()
    self.done.acquire()
    self.task, self.error = None, None
    threading.Thread(target=self._loop, daemon=True, name="numpy-matmul").start()

  def _loop(self) -> None:
    while True:
      self.go.acquire()
      part, lo, hi = self.task
      try:
        part(lo, hi)
      except BaseException as e:  # handed to the caller by wait()
        self.error = e
      self.done.release()

  def start(self, part: Callable[[int, int], None], lo: int, hi: int) -> None:
    self.task, self.error = (part, lo, hi), None
    self.go.release()

  def wait(self) -> Optional[BaseException]:
    self.done.acquire()
    return self.error


# The small-matrix kernel runs on one thread; a step with enough rows splits its blocks over the cores instead.
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
PARALLEL_ROWS = 8  # below this the hand-over costs more than the other cores save (measured: 4 rows 2% faster, 8 rows 10%)


def _start_workers() -> None:
  global _workers, _workers_busy
  _workers = [_Worker() for _ in range(CORES - 1)]
  _workers_busy = threading.Lock()  # one product at a time; another engine's thread in this process meanwhile runs alone


_start_workers()
if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_start_workers)  # a forked child has none of its parent's threads to hand work to


def split_over_cores(part: Callable[[int, int], None], n: int) -> None:
  """part(lo, hi) for each of CORES even slices of range(n), at once."""
  if not _workers or not _workers_busy.acquire(blocking=False):
    part(0, n)
    return
  try:
    bounds = [n * i // CORES for i in range(CORES + 1)]
    for worker, lo, hi in zip(_workers, bounds[1:], bounds[2:]):
      worker.start(part, lo, hi)
    part(bounds[0], bounds[1])
  finally:
    errors = [worker.wait() for worker in _workers]
    _workers_busy.release()
  for error in errors:
    if error is not None:
      raise error


ROW_SPLIT_ROWS = 16  # from here a step's requests are shared among the cores, each running all layers for its own
ROW_SPLIT_SKEW = 1.25  # ... unless some core would get more than this times its fair share of the rows


def balanced_groups(lengths: Sequence[int], parts: int) -> List[Tuple[int, int]]:
  """Contiguous runs of requests, (first, end), with about equal rows each; one run when the rows cannot be shared.

  From ROW_SPLIT_ROWS rows on, a step runs faster as several smaller steps at once, one per core, than as one step
  whose products alone are split: the cores then also share the attention and the rest of the Python work, and hand
  work over once per step instead of four times per layer (16 rows: about 5-10% faster, 32 rows: 10%). Below that,
  or when one long prompt makes most of the rows, the products are split instead (see `matmul`)."""
  total = sum(lengths)
  if parts < 2 or len(lengths) < 2 or total < ROW_SPLIT_ROWS:
    return [(0, len(lengths))]
  cuts, rows = [0], 0
  for i, n in enumerate(lengths[:-1]):
    rows += n
    if len(cuts) < parts and rows >= total * len(cuts) / parts:
      cuts.append(i + 1)
  cuts.append(len(lengths))
  if max(sum(lengths[a:b]) for a, b in zip(cuts, cuts[1:])) > ROW_SPLIT_SKEW * total / parts:
    return [(0, len(lengths))]
  return list(zip(cuts, cuts[1:]))


def matmul(x: np.ndarray, blocks: np.ndarray, n_out: int) -> np.ndarray:
  """x (rows, in) @ the weight `blocks` stand for -> (rows, n_out)."""
  rows, n_in = x.shape
  n_blocks = blocks.shape[0]
  out = np.empty((rows, n_blocks * BLOCK), dtype=np.float32)
  group = max(1, SMALL_GEMM // (BLOCK * n_in))

  def run(lo: int, hi: int) -> None:  # output blocks lo..hi; numpy releases the GIL inside matmul
    for start in range(0, rows, group):
      part = np.matmul(x[start:start + group], blocks[lo:hi])  # (hi - lo, rows, BLOCK)
      out[start:start + group].reshape(part.shape[1], n_blocks, BLOCK)[:, lo:hi] = part.transpose(1, 0, 2)

  if rows < PARALLEL_ROWS:
    run(0, n_blocks)
  else:
    split_over_cores(run, n_blocks)
  return out[:, :n_out] if n_out != out.shape[1] else out


def zeros_in_small_pages(shape) -> np.ndarray:
  """A float32 zero array whose memory the kernel maps in 4 KiB pages as it is first written.

  Untouched pages cost no memory, so a cache can reserve room for many positions up front. numpy would ask for
  transparent huge pages; a huge page may first need the kernel to compact memory, and when several requests'
  caches grew in the same step that stalled the step by up to 250 ms."""
  buffer = mmap.mmap(-1, max(1, math.prod(shape) * 4))  # anonymous, zero-filled; unmapped with the array
  if hasattr(mmap, "MADV_NOHUGEPAGE"):
    buffer.madvise(mmap.MADV_NOHUGEPAGE)
  return np.frombuffer(buffer, dtype=np.float32, count=math.prod(shape)).reshape(shape)


RESERVED_POSITIONS = 1024  # a new cache's room: address space only until written, and most requests never outgrow it
GROW_AHEAD = 0.75  # a cache this full may grow one step early


class KVCache:
  """One request's keys and values for this shard's layers: (layers, k/v, kv heads, positions, head dim)."""

  def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int = RESERVED_POSITIONS):
    self.data = zeros_in_small_pages((n_layers, 2, n_kv_heads, capacity, head_dim))
    self.length = 0

  @property
  def capacity(self) -> int:
    return self.data.shape[3]

  def reserve(self, length: int) -> bool:
    """Room for `length` positions; True if the cache had to grow (to twice its size, or more)."""
    if length <= self.capacity:
      return False
    grown = zeros_in_small_pages(self.data.shape[:3] + (max(length, 2 * self.capacity), self.data.shape[4]))
    grown[:, :, :, :self.length] = self.data[:, :, :, :self.length]
    self.data = grown
    return True

  @property
  def nbytes(self) -> int:
    """Memory in use: the pages the written positions occupy in each (layer, k/v, head) row."""
    rows, row_bytes = math.prod(self.data.shape[:3]), self.length * self.data.shape[4] * 4
    return rows * -(-row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
  return x * (1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * weight


class Llama:
  def __init__(self, config: LlamaConfig, shard: Shard, weights: Dict[str, np.ndarray]):
    self.config, self.shard = config, shard
    self.layers = []
    for i in range(shard.start_layer, shard.end_layer + 1):
      p = f"model.layers.{i}."
      w = lambda name: weights[p + name]
      self.layers.append({
        "attn_norm": w("input_layernorm.weight"), "mlp_norm": w("post_attention_layernorm.weight"),
        # Fused and blocked so each projection is one `matmul`.
        "qkv": block_weight(np.concatenate([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]).T),
        "o": block_weight(w("self_attn.o_proj.weight").T),
        "gate_up": block_weight(np.concatenate([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]).T),
        "down": block_weight(w("mlp.down_proj.weight").T),
      })
    self.embed = weights.get("model.embed_tokens.weight") if shard.is_first_layer() else None
    if shard.is_last_layer():
      self.norm = weights["model.norm.weight"]
      self.head = block_weight(weights.get("lm_head.weight", weights.get("model.embed_tokens.weight")).T)
    self.inv_freq = rope_inv_freq(config)

  def new_cache(self) -> KVCache:
    return KVCache(len(self.layers), self.config.n_kv_heads, self.config.head_dim)

  def _rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

  def forward(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> List[np.ndarray]:
    """inputs[i]: token ids (L_i,) on the first shard, else hidden states (L_i, d).
    Returns per request: hidden states (L_i, d), or on the last shard the logits of its last position (1, vocab)."""
    c = self.config
    lengths = [len(x) for x in inputs]
    grew = [cache.reserve(cache.length + n) for cache, n in zip(caches, lengths)]
    fullest = max(caches, key=lambda cache: (cache.length + 1) / cache.capacity)
    if not any(grew) and fullest.length >= GROW_AHEAD * fullest.capacity:
      # Requests that run in step fill their caches together; growing one ahead of time per step spreads the
      # copying out instead of stalling every stream in the one step where they would all grow.
      fullest.reserve(fullest.capacity + 1)
    groups = balanced_groups(lengths, CORES)
    if len(groups) == 1:
      h = self._layers(inputs, caches)
    else:
      outputs = [None] * len(groups)

      def run(lo: int, hi: int) -> None:
        for g in range(lo, hi):
          a, b = groups[g]
          outputs[g] = self._layers(inputs[a:b], caches[a:b])
      split_over_cores(run, len(groups))
      h = np.concatenate(outputs)

    offsets = np.cumsum([0] + lengths)
    if not self.shard.is_last_layer():
      return [h[offsets[r]:offsets[r + 1]] for r in range(len(inputs))]
    last = h[offsets[1:] - 1]  # only each request's last position is ever sampled
    logits = matmul(rms_norm(last, self.norm, c.rms_norm_eps), self.head, c.vocab_size)
    return [logits[r:r + 1] for r in range(len(inputs))]

  def _layers(self, inputs: Sequence[np.ndarray], caches: Sequence[KVCache]) -> np.ndarray:
    """The shard's layers for these requests: their hidden states, all rows, (sum of L_i, d)."""
    c = self.config
    lengths = [len(x) for x in inputs]
    starts = [cache.length for cache in caches]
    if self.embed is not None:
      h = self.embed[np.concatenate([np.asarray(x, dtype=np.int64).reshape(-1) for x in inputs])]
    else:
      h = np.concatenate([np.asarray(x, dtype=np.float32).reshape(-1, c.hidden_size) for x in inputs])
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    angles = positions[:, None].astype(np.float32) * self.inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    hd, n_heads, n_kv = c.head_dim, c.n_heads, c.n_kv_heads
    group, q_size, kv_size = n_heads // n_kv, n_heads * hd, n_kv * hd
    rows, width = h.shape[0], max(s + n for s, n in zip(starts, lengths))
    offsets = np.cumsum([0] + lengths)
    # Buffers reused by every layer, so that each request's slices of them are cut once per step, not per layer: the
    # per-request loops below are most of a decode step's Python work.
    q = np.empty((n_kv, rows * group, hd), dtype=np.float32)
    new_kv = np.empty((2, n_kv, rows, hd), dtype=np.float32)
    # Scores of all requests share one (kv head, row x group, key) array so softmax runs once for the step. A row
    # sees keys up to its own position; that one mask also hides the unused tail of shorter requests' rows.
    scores = np.empty((n_kv, rows * group, width), dtype=np.float32)
    attn = np.empty((n_kv, rows * group, hd), dtype=np.float32)
    hidden = np.repeat(np.arange(width)[None, :] > positions[:, None], group, axis=0)
    spans = [(cache.data, s, s + n, slice(a, b), slice(a * group, b * group))
             for cache, s, n, a, b in zip(caches, starts, lengths, offsets[:-1], offsets[1:])]
    # per request: (where its new keys and values go, they, its queries, its keys transposed, its scores) ...
    scoring = [(kv[:, :, :, s:e], new_kv[:, :, r], q[:, g], kv[:, 0, :, :e].transpose(0, 1, 3, 2), scores[:, g, :e]) for kv, s, e, r, g in spans]
    # ... and (its weights, its values, its output rows)
    mixing = [(scores[:, g, :e], kv[:, 1, :, :e], attn[:, g]) for kv, s, e, r, g in spans]
    for li, layer in enumerate(self.layers):
      qkv = matmul(rms_norm(h, layer["attn_norm"], c.rms_norm_eps), layer["qkv"], q_size + 2 * kv_size)
      qk = self._rope(qkv[:, :q_size + kv_size].reshape(rows, n_heads + n_kv, hd), cos, sin)  # queries and keys turn alike
      q.reshape(n_kv, rows, group, hd)[:] = (qk[:, :n_heads] * np.float32(1.0 / math.sqrt(hd))).reshape(rows, n_kv, group, hd).transpose(1, 0, 2, 3)
      new_kv[0], new_kv[1] = qk[:, n_heads:].transpose(1, 0, 2), qkv[:, q_size + kv_size:].reshape(rows, n_kv, hd).transpose(1, 0, 2)
      for kv_at, kv_new, q_rows, keys, score_rows in scoring:
        kv_at[li] = kv_new
        np.matmul(q_rows, keys[li], out=score_rows)
      np.copyto(scores, -np.inf, where=hidden)
      scores -= scores.max(axis=-1, keepdims=True)
      np.exp(scores, out=scores)
      scores /= scores.sum(axis=-1, keepdims=True)
      for score_rows, values, attn_rows in mixing:
        np.matmul(score_rows, values[li], out=attn_rows)
      h = h + matmul(attn.reshape(n_kv, rows, group, hd).transpose(1, 0, 2, 3).reshape(rows, q_size), layer["o"], c.hidden_size)
      gate_up = matmul(rms_norm(h, layer["mlp_norm"], c.rms_norm_eps), layer["gate_up"], 2 * c.intermediate_size)
      gate, up = gate_up[:, :c.intermediate_size], gate_up[:, c.intermediate_size:]
      h = h + matmul((gate / (1.0 + np.exp(-gate))) * up, layer["down"], c.hidden_size)
    for cache, s, n in zip(caches, starts, lengths):
      cache.length = s + n
    return h

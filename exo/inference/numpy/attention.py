"""Attention of one numpy step, over the KV pool (cache.py), and how the cores share it.

Decode rows of requests in consecutive slots are one batched product over a strided view of those slots, each row
masked to its own length (DecodeRun); a prompt chunk attends on its own with a causal mask, its keys in blocks
(PromptChunk). Softmax is taken unshifted where that is exact (see exact_enough). The cores share attention by
requests, cut so that each has about as much of it to compute (share)."""
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from exo.inference.llama_layout import StepRows
from exo.inference.numpy.cache import SLAB_SLOTS, KVCache, KVPool
from exo.inference.numpy import decode_attention
from exo.inference.numpy.halves import widen
from exo.inference.numpy.kernels import CORES, PARALLEL_ROWS

SCORE_TILE_BYTES = 1 << 20  # a prompt chunk's attention scores at a time (about a core's L2 cache)
PROMPT_TILE_ROWS = 64  # a prompt chunk's rows at a time: a block of keys serves 3 x this many query rows, and a fresh
# prompt's causal triangle wastes little (64: 10-25% faster than 128 or 256 at 24-512 rows)
MIN_KEY_BLOCK = 128  # keys at a time, at least (fewer make the product with the values too thin to run well)
PADDING_LIMIT = 1.25  # a run of decode rows pads every row to the run's longest; past this much padding a new run starts
PROMPT_POSITION_COST = 0.3  # a prompt row's attention per position it sees, as a share of a decode row's (its rows
# share each key read, in products: 30 against 110 ns a position on one core of this VM)
NO_SINKS = np.zeros(0, dtype=np.float32)
MIN_TOTAL = 1e-18  # a row's sum of exp(score) below this may have lost terms to underflow: it is computed again, shifted


def widened(cached: np.ndarray) -> np.ndarray:
  """Part of the cache as float32 for a product: a float16 cache widened by halves.py (numpy's own conversion took
  twice the whole step's time at 16 streams), a float32 one read where it lies."""
  return widen(cached) if cached.dtype == np.float16 else cached


def soft_cap(x: np.ndarray, cap: float) -> None:
  """cap * tanh(x / cap), in place (Gemma 2's scores and logits)."""
  x /= np.float32(cap)
  np.tanh(x, out=x)
  x *= np.float32(cap)


def finish_logits(logits: np.ndarray, c) -> None:
  """The head's products made the model's logits, in place: its scale and final soft cap (both ways of running a
  step end here, llama.py's layers and the fused pass)."""
  if c.logits_scale != 1.0:
    logits *= np.float32(c.logits_scale)
  if c.final_softcap is not None:
    soft_cap(logits, c.final_softcap)


def exact_enough(total: np.ndarray, out: np.ndarray) -> bool:
  """Whether attention computed with exp(score), not exp(score - row max), is as exact as the shifted form.

  Softmax is the same whatever is subtracted from a row's scores, and float32's exp and sums are as exact at any
  magnitude, so the shift only guards against overflow (a score above 88) and against a row whose every weight
  underflows. Scores stay far from both here (SmolLM2: -22 to 29), and leaving the shift out saves two passes over
  the scores and lets a prompt's keys be taken in blocks. A row that overflowed shows as inf or nan; a row whose
  total is below MIN_TOTAL had its largest score below about -50, where terms 37 orders smaller may have been lost.
  Either way the caller computes it again, shifted."""
  return bool(np.isfinite(total).all() and total.min() >= MIN_TOTAL and np.isfinite(out).all())


class DecodeRun:
  """Requests in consecutive slots of one slab, one new row each (rows first..first + n of the step): their
  attention is one batched product over a view of those slots, each row masked to its own length."""

  def __init__(self, slab: np.ndarray, slot: int, first: int, ends: np.ndarray):
    self.slab, self.slot, self.first, self.ends = slab, slot, first, ends  # ends: positions each row sees
    self.width = int(ends.max())
    self.masks = {}  # window (None: every position) -> its mask, made when numpy's path first needs it

  def mask_for(self, window: Optional[int]) -> np.ndarray:
    """The mask over (query head, row, KV head, position) of a layer whose queries see only the last `window`
    positions (None: all)."""
    key = None if window is None or window >= self.width else window
    if key not in self.masks:
      positions = np.arange(self.width)[None, :]
      hidden = positions >= self.ends[:, None]
      if key is not None:
        hidden |= positions < self.ends[:, None] - key
      self.masks[key] = np.where(hidden, -np.inf, 0.0).astype(np.float32)[:, None, :]
    return self.masks[key]

  @property
  def cost(self) -> int:  # cached positions read
    return len(self.ends) * self.width

  def split(self, n: int) -> Tuple["DecodeRun", "DecodeRun"]:
    return (DecodeRun(self.slab, self.slot, self.first, self.ends[:n]),
            DecodeRun(self.slab, self.slot + n, self.first + n, self.ends[n:]))

  def attend(self, li: int, q: np.ndarray, attn: np.ndarray, n_kv: int, window: Optional[int] = None, softcap: Optional[float] = None,
             sinks: Optional[np.ndarray] = None, shifted: bool = False) -> None:
    """Layer li's attention of these rows into attn; `window`: the layer's sliding window; `softcap`: scores become
    softcap * tanh(scores / softcap); `sinks`: each query head's logit that joins its softmax's denominator (and
    adds no value). A slot of one plane (latent attention) holds keys that are their own values."""
    if self.slab.dtype == np.float32 and decode_attention.available():
      decode_attention.attend_decode(self.slab, self.slot, li, q, self.first, self.ends, window or 0, np.float32(softcap or 0.0),
                                     NO_SINKS if sinks is None else np.asarray(sinks, dtype=np.float32), attn)
      return
    n, width, (_, n_heads, hd) = len(self.ends), self.width, q.shape
    rows, slots = slice(self.first, self.first + n), self.slab[self.slot:self.slot + n, li]
    # a sliding layer reads from the first position any row sees (those before went back to the kernel: cache.py)
    lo = 0 if window is None else max(0, int(self.ends.min()) - window)
    keys = widened(slots[:, 0, :, lo:width])  # (n, kv heads, width - lo, head dim)
    values = keys if slots.shape[1] == 1 else widened(slots[:, -1, :, lo:width])
    sink_logits = None if sinks is None else sinks.reshape(n_kv, -1).T[:, None, :, None]  # as the scores' (group, n, kv heads, 1)
    # Each query head a column of its own: numpy hands a product whose last dimension is 1 to sgemv. A KV head's 3
    # query heads as one 3-row sgemm cost more to set up than to compute: for 64 requests of 131 positions, a layer's
    # attention took 3.8 ms on one core that way, 2.5 ms as matrix-vector products.
    queries = q[rows].reshape(n, n_kv, n_heads // n_kv, hd).transpose(2, 0, 1, 3)[..., None]  # (group, n, kv heads, head dim, 1)
    scores = np.matmul(keys, queries)[..., 0]  # (group, n, kv heads, width)
    if softcap is not None:
      soft_cap(scores, softcap)
    scores += self.mask_for(window)[..., lo:]
    shift = None
    if shifted:
      shift = scores.max(axis=-1, keepdims=True) if sink_logits is None else np.maximum(scores.max(axis=-1, keepdims=True), sink_logits)
      scores -= shift
    with np.errstate(over="ignore", invalid="ignore"):  # exact_enough finds it
      np.exp(scores, out=scores)
      total = scores.sum(axis=-1, keepdims=True)
      if sink_logits is not None:
        total += np.exp(sink_logits if shift is None else sink_logits - shift)
      out = np.matmul(values.swapaxes(-1, -2), scores[..., None])[..., 0]  # (group, n, kv heads, head dim)
    if not shifted and not exact_enough(total, out):
      return self.attend(li, q, attn, n_kv, window, softcap, sinks, shifted=True)
    out /= total
    attn[rows] = out.transpose(1, 2, 0, 3).reshape(n, n_heads * hd)


class PromptChunk:
  """n rows of one request's prompt (rows first..first + n of the step), from position `start`: causal attention
  over its own slot."""

  def __init__(self, slab: np.ndarray, slot: int, first: int, start: int, n: int):
    self.slab, self.slot, self.first, self.start, self.n = slab, slot, first, start, n
    # Only among its own rows does a key come after a query: every cached position before `start` is seen by all.
    self.mask = np.where(np.arange(n)[None, :] > np.arange(n)[:, None], -np.inf, 0.0).astype(np.float32)

  @property
  def cost(self) -> float:  # as a decode row's cached positions
    return PROMPT_POSITION_COST * self.seen(self.n)

  def seen(self, rows: int) -> int:
    """Positions its first `rows` rows attend to (causal: the later rows see more)."""
    return rows * self.start + rows * (rows + 1) // 2

  def rows_costing(self, cost: float) -> int:
    """How many of its first rows cost about `cost`: where to cut it between two cores."""
    b = self.start + 0.5
    return round(math.sqrt(b * b + 2 * cost / PROMPT_POSITION_COST) - b)

  def split(self, n: int) -> Tuple["PromptChunk", "PromptChunk"]:
    """Its first n rows and the rest: a long cached prefix (a prefix cache hit) makes one chunk's attention a core's worth."""
    return (PromptChunk(self.slab, self.slot, self.first, self.start, n),
            PromptChunk(self.slab, self.slot, self.first + n, self.start + n, self.n - n))

  def attend(self, li: int, q: np.ndarray, attn: np.ndarray, n_kv: int, window: Optional[int] = None, softcap: Optional[float] = None,
             sinks: Optional[np.ndarray] = None) -> None:
    """As DecodeRun.attend."""
    for a in range(0, self.n, PROMPT_TILE_ROWS):
      b = min(a + PROMPT_TILE_ROWS, self.n)
      # each sink as the scores' (kv heads, group * rows, 1)
      sink_logits = None if sinks is None else np.repeat(sinks.reshape(n_kv, -1), b - a, axis=1)[..., None]
      if not self._attend(li, q, attn, n_kv, a, b, window, softcap, sink_logits):
        shift = self._row_max(li, q, n_kv, a, b, window, softcap)
        self._attend(li, q, attn, n_kv, a, b, window, softcap, sink_logits, shift=shift if sinks is None else np.maximum(shift, sink_logits))

  def _blocks(self, li: int, q: np.ndarray, n_kv: int, a: int, b: int, window: Optional[int], softcap: Optional[float]):
    """(keys from, to, masked scores) for rows a..b, their keys taken in blocks whose scores fit the core's cache:
    rows a..b see positions up to start + b - 1, and only positions from `start` on are hidden from some of them
    (and, in a sliding layer, those `window` or more before a row's own)."""
    n, width, (_, n_heads, hd) = b - a, self.start + b, q.shape
    keys = self.slab[self.slot, li, 0]  # (kv heads, positions, head dim)
    queries = q[self.first + a:self.first + b].reshape(n, n_kv, n_heads // n_kv, hd).transpose(1, 2, 0, 3).reshape(n_kv, -1, hd)
    block = max(MIN_KEY_BLOCK, SCORE_TILE_BYTES // (4 * n_heads * n))
    first_seen = 0 if window is None else max(0, self.start + a + 1 - window)  # row a's window starts there
    for k0 in range(first_seen, width, block):
      k1 = min(k0 + block, width)
      scores = np.matmul(queries, keys[:, k0:k1].swapaxes(-1, -2))  # (kv heads, group * n, k1 - k0)
      if softcap is not None:
        soft_cap(scores, softcap)
      lo = max(k0, self.start)
      if lo < k1:
        scores.reshape(n_kv, -1, n, k1 - k0)[..., lo - k0:] += self.mask[a:b, lo - self.start:k1 - self.start]
      if window is not None and k0 <= self.start + b - 1 - window:  # some row of these sees a key no more
        hidden = np.arange(k0, k1)[None, :] <= (self.start + np.arange(a, b))[:, None] - window
        scores.reshape(n_kv, -1, n, k1 - k0)[...] += np.where(hidden, -np.inf, 0.0).astype(np.float32)
      yield k0, k1, scores

  def _row_max(self, li: int, q: np.ndarray, n_kv: int, a: int, b: int, window: Optional[int], softcap: Optional[float]) -> np.ndarray:
    return np.max([scores.max(axis=-1, keepdims=True) for _, _, scores in self._blocks(li, q, n_kv, a, b, window, softcap)], axis=0)

  def _attend(self, li: int, q: np.ndarray, attn: np.ndarray, n_kv: int, a: int, b: int, window: Optional[int], softcap: Optional[float],
              sink_logits: Optional[np.ndarray], shift=None) -> bool:
    """Rows a..b's attention into attn; False, writing nothing, if unshifted exp was not exact enough (exact_enough)."""
    n, (_, n_heads, hd) = b - a, q.shape
    values = self.slab[self.slot, li, -1]
    out, total = np.zeros((n_kv, n_heads // n_kv * n, hd), dtype=np.float32), np.zeros((n_kv, n_heads // n_kv * n, 1), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # exact_enough finds it
      for k0, k1, scores in self._blocks(li, q, n_kv, a, b, window, softcap):
        if shift is not None:
          scores -= shift
        np.exp(scores, out=scores)
        total += scores.sum(axis=-1, keepdims=True)
        out += np.matmul(scores, values[:, k0:k1])
      if sink_logits is not None:
        total += np.exp(sink_logits if shift is None else sink_logits - shift)
    if shift is None and not exact_enough(total, out):
      return False
    out /= total
    attn[self.first + a:self.first + b] = out.reshape(n_kv, -1, n, hd).transpose(2, 0, 1, 3).reshape(n, n_heads * hd)
    return True


class Step:
  """What every layer of one step shares: where each row's keys go, and who attends with whom. The requests come
  in slot order."""

  def __init__(self, pool: KVPool, caches: Sequence[KVCache], lengths: Sequence[int]):
    starts = [cache.length for cache in caches]
    self.layout = StepRows(lengths, starts)
    self.rows, self.positions = self.layout.rows, self.layout.positions
    # Cache writes, one per slab: (slab, row range, slot index per row, position per row).
    self.writes: List[Tuple[np.ndarray, slice, np.ndarray, np.ndarray]] = []
    slot_of_row = np.repeat([cache.slot for cache in caches], lengths)
    for slab in np.unique(slot_of_row // SLAB_SLOTS):
      rows = np.flatnonzero(slot_of_row // SLAB_SLOTS == slab)
      self.writes.append((pool.slabs[slab], slice(rows[0], rows[-1] + 1), slot_of_row[rows] % SLAB_SLOTS, self.positions[rows]))

    jobs: List = []
    run: List[int] = []  # requests of the decode run being gathered
    offsets = np.cumsum([0] + list(lengths))

    def close_run():
      if run:
        slab, index = pool.where(caches[run[0]].slot)
        jobs.append(DecodeRun(slab, index, int(offsets[run[0]]), np.array([starts[r] + 1 for r in run])))
        run.clear()

    for r, (cache, n) in enumerate(zip(caches, lengths)):
      if n > 1:
        close_run()
        jobs.append(PromptChunk(*pool.where(cache.slot), int(offsets[r]), starts[r], n))
        continue
      if run:
        widths = [starts[i] + 1 for i in run] + [starts[r] + 1]
        if cache.slot != caches[run[-1]].slot + 1 or cache.slot % SLAB_SLOTS == 0 or len(widths) * max(widths) > PADDING_LIMIT * sum(widths):
          close_run()
      run.append(r)
    close_run()
    self.job_groups = share(jobs, CORES) if self.rows >= PARALLEL_ROWS and CORES > 1 else [jobs]


def share(jobs: List, parts: int) -> List[List]:
  """The jobs in `parts` consecutive groups of about equal cost; a decode run or prompt chunk is cut where a group
  fills up."""
  total = sum(job.cost for job in jobs)
  groups: List[List] = [[] for _ in range(parts)]
  g, filled = 0, 0.0
  for job in jobs:
    while job is not None:
      room = total * (g + 1) / parts - filled
      if isinstance(job, DecodeRun) and g < parts - 1 and job.cost > room and len(job.ends) > 1:
        head, job = job.split(min(len(job.ends) - 1, max(1, round(room / job.width))))
      elif isinstance(job, PromptChunk) and g < parts - 1 and job.cost > room and job.n > 1:
        head, job = job.split(min(job.n - 1, max(1, job.rows_costing(room))))
      else:
        head, job = job, None
      groups[g].append(head)
      filled += head.cost
      if g < parts - 1 and (job is not None or filled >= total * (g + 1) / parts):
        g += 1
  return [group for group in groups if group]

"""Vectorised sampling shared by every engine: one call for many rows, each with its own parameters."""
from dataclasses import asdict, dataclass, fields
from typing import List, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
  """What one request asked for. temperature 0 means greedy (argmax)."""
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0  # 0 = no limit
  min_p: float = 0.0
  seed: Optional[int] = None
  max_tokens: Optional[int] = None  # None = the node's max_generate_tokens
  ignore_eos: bool = False  # generate exactly max_tokens (benchmarks), as vLLM's extension of the same name
  logprobs: Optional[int] = None  # None = none; k = each token's log-probability and its k most likely alternatives
  grammar: Optional[str] = None  # Lark text (llguidance's dialect) the answer must follow; see exo/inference/grammar.py
  bounded_numbers: bool = True  # the grammar's JSON numbers keep within exo/inference/json_numbers.py's bounds
  # Logit processors (exo/inference/penalties.py); the defaults change nothing.
  frequency_penalty: float = 0.0
  presence_penalty: float = 0.0
  repetition_penalty: float = 1.0
  penalty_window: Optional[int] = None  # the last n tokens of prompt and answer are counted; None: the answer (and prompt for repetition)
  penalty_prompt: Tuple[int, ...] = ()  # the prompt's tokens, sent when a penalty counts them
  logit_bias: Tuple[Tuple[int, float], ...] = ()  # (token id, bias); -100 bans
  min_tokens: int = 0  # end tokens are banned until the answer holds this many

  def to_dict(self) -> dict:
    return asdict(self)

  @staticmethod
  def from_dict(data: dict) -> "SamplingParams":
    known = {f.name for f in fields(SamplingParams)}
    values = {k: v for k, v in data.items() if k in known}
    # JSON has lists where these have tuples (left as they are when malformed: the peer's check says why).
    if isinstance(values.get("penalty_prompt"), list):
      values["penalty_prompt"] = tuple(values["penalty_prompt"])
    if isinstance(values.get("logit_bias"), list) and all(isinstance(pair, list) for pair in values["logit_bias"]):
      values["logit_bias"] = tuple(tuple(pair) for pair in values["logit_bias"])
    return SamplingParams(**values)


def make_generator(seed: Optional[int]) -> np.random.Generator:
  """A request's own random stream, so its tokens do not depend on who shares its batch."""
  return np.random.Generator(np.random.PCG64(seed))


# Most of a distribution's mass sits in its tokens within a small factor of the best one: a row with top-k, top-p or
# min-p looks among those first (a value threshold, so they are exactly the first tokens of the sorted vocabulary),
# then below a lower floor, and sorts its whole vocabulary only when its kept set might reach past those.
WEIGHT_FLOORS = (1e-4, 1e-9)  # exp(scaled logit - the best's)
SAMPLING_BLOCK = 256  # tokens a whole-vocabulary draw sums at once (_inverse_cdf)


def last_rows(logits: Sequence[np.ndarray]) -> np.ndarray:
  """The last position of each request's logits, stacked (N, vocab)."""
  return np.stack([np.asarray(x).reshape(-1, np.shape(x)[-1])[-1] for x in logits])


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams], generators: Sequence[np.random.Generator]) -> np.ndarray:
  """Sample one token per row of `logits` (N, vocab); returns int64 ids (N,)."""
  logits = np.asarray(logits, dtype=np.float32).reshape(len(params), -1)
  tokens = np.argmax(logits, axis=-1).astype(np.int64)
  sampled = [i for i, p in enumerate(params) if p.temperature > 0]
  if not sampled:
    return tokens
  rows = logits[sampled] if len(sampled) < len(params) else logits
  temps = np.array([params[i].temperature for i in sampled], dtype=np.float32)[:, None]
  top_k = np.array([params[i].top_k for i in sampled])
  top_p = np.array([params[i].top_p for i in sampled], dtype=np.float32)[:, None]
  min_p = np.array([params[i].min_p for i in sampled], dtype=np.float32)[:, None]
  vocab = rows.shape[-1]
  # A row without top-k measures top-p against its whole vocabulary's mass; with top-k, against its k best.
  full_weights = rows / temps  # then in place (each fresh array of a 49k vocabulary costs its page faults):
  full_weights -= full_weights.max(axis=-1, keepdims=True)  # relative to each row's best token
  np.exp(full_weights, out=full_weights)
  full_mass = full_weights.sum(axis=-1, keepdims=True)
  picks = np.empty(len(sampled), dtype=np.int64)
  # A row that keeps every token (a temperature alone, the usual request) draws over its vocabulary in id order: its
  # candidates would never hold its kept set, and sorting a 49k vocabulary took ~9 ms a row.
  whole = (top_k <= 0) & (top_p[:, 0] >= 1.0) & (min_p[:, 0] <= 0.0)
  for i in np.nonzero(whole)[0]:
    picks[i] = _inverse_cdf(full_weights[i], generators[sampled[i]].random())
  for i in np.nonzero(~whole)[0]:
    picks[i] = _draw_among_best(rows[i], full_weights[i], int(top_k[i]), float(top_p[i, 0]), float(min_p[i, 0]), full_mass[i, 0],
                                generators[sampled[i]].random())
  tokens[sampled] = picks
  return tokens


def _inverse_cdf(weights: np.ndarray, fraction: float) -> int:
  """The token at `fraction` of a row's cumulative weights in id order (never one of weight 0), found block by block:
  a cumsum runs element by element, a block's sum is vectorised (a 49k cumsum took most of a sampled step's loop)."""
  starts = np.arange(0, len(weights), SAMPLING_BLOCK)
  sums = np.add.reduceat(weights, starts)
  cumulative = np.cumsum(sums)
  target = fraction * cumulative[-1]
  b = min(int(np.searchsorted(cumulative, target, side="right")), int(np.flatnonzero(sums)[-1]))  # (rounding may step past the last)
  block = weights[starts[b]:starts[b] + SAMPLING_BLOCK]
  j = int(np.searchsorted(np.cumsum(block), target - (cumulative[b - 1] if b else 0.0), side="right"))
  return int(starts[b]) + min(j, int(np.flatnonzero(block)[-1]))


def _draw_among_best(row: np.ndarray, weights: np.ndarray, top_k: int, top_p: float, min_p: float, full_mass: float, fraction: float) -> int:
  """A row's token by top-k, then min-p, then top-p, drawn at `fraction` of its kept set's mass, best first (ties by
  id), as if its whole vocabulary were sorted: the tokens above a weight floor are the sorted order's first ones, and a
  floor is lowered until the kept set ends before its last candidate."""
  vocab = len(weights)
  for floor in (*WEIGHT_FLOORS, 0.0):
    candidates = np.flatnonzero(weights >= floor) if floor > 0 else np.arange(vocab)
    if floor > 0 and top_k > len(candidates):
      continue  # the k best reach below the floor
    if 0 < top_k < len(candidates):  # only the k best can be kept (with any tied with the k-th, for the order's sake)
      values = row[candidates]
      candidates = candidates[values >= np.partition(values, len(values) - top_k)[len(values) - top_k]]
    candidates = candidates[np.argsort(-row[candidates], kind="stable")]
    kept_weights = weights[candidates]
    if 0 < top_k < len(candidates):
      kept_weights[top_k:] = 0.0
    cumulative = np.cumsum(kept_weights)
    mass = cumulative[-1] if 0 < top_k <= len(candidates) else full_mass  # top-p measures against the k best, or everything
    keep = (kept_weights >= min_p * kept_weights[0]) & (cumulative - kept_weights < top_p * mass)
    keep[0] = True
    if floor > 0 and keep[-1] and kept_weights[-1] > 0 and not 0 < top_k <= len(candidates):
      continue  # the kept set may go on below the floor
    cdf = np.cumsum(np.where(keep, kept_weights, 0.0))
    return int(candidates[min(int((cdf <= fraction * cdf[-1]).sum()), len(candidates) - 1)])
  raise AssertionError("unreachable: the last floor holds every token")


MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs
IMPOSSIBLE_LOGPROB = -9999.0


@dataclass(frozen=True)
class TokenLogprobs:
  """A sampled token's log-probability and the `top` most likely tokens at its position, as (id, logprob), best first."""
  logprob: float
  top: List[Tuple[int, float]]


def token_logprobs(logits: np.ndarray, params: Sequence[SamplingParams], tokens: Sequence[int]) -> List[Optional[TokenLogprobs]]:
  """For each row whose request asked for logprobs: log-softmax of the distribution it was sampled from (its logits
  over its temperature; greedy rows as they are), at the sampled token and at its best tokens (ties by id). One
  vectorised pass for all of those rows; the others get None."""
  wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
  out: List[Optional[TokenLogprobs]] = [None] * len(params)
  if not wanted:
    return out
  rows = np.asarray(logits, dtype=np.float32).reshape(len(params), -1)[wanted]
  temps = np.array([params[i].temperature if params[i].temperature > 0 else 1.0 for i in wanted], dtype=np.float32)[:, None]
  scaled = rows / temps
  top_max = scaled.max(axis=-1, keepdims=True)
  log_total = top_max + np.log(np.exp(scaled - top_max).sum(axis=-1, keepdims=True))  # >= top_max, so every logprob <= 0
  k = min(max(params[i].logprobs for i in wanted), scaled.shape[-1])
  best = np.array([_best_tokens(row, k) if k else [] for row in scaled], dtype=np.int64).reshape(len(wanted), k)
  # A token a grammar rules out has -inf: reported as OpenAI reports impossible tokens, -9999 (JSON has no infinity).
  best_logprobs = np.clip(np.take_along_axis(scaled, best, axis=-1) - log_total, IMPOSSIBLE_LOGPROB, 0.0)
  chosen = np.clip(scaled[np.arange(len(wanted)), [int(tokens[i]) for i in wanted]] - log_total[:, 0], IMPOSSIBLE_LOGPROB, 0.0)
  for row, i in enumerate(wanted):
    n = params[i].logprobs
    out[i] = TokenLogprobs(float(chosen[row]), [(int(t), float(lp)) for t, lp in zip(best[row, :n], best_logprobs[row, :n])])
  return out


def _best_tokens(row: np.ndarray, k: int) -> np.ndarray:
  """The k best tokens of a row, best first, ties by id: looked for among those within a few nats of the best (a
  model's 20 best nearly always are), where a partition of the whole vocabulary took ~0.5 ms a row."""
  for window in (5.0, 10.0, 20.0, np.inf):
    pool = np.flatnonzero(row >= row.max() - window)
    if len(pool) >= k:
      break
  values = row[pool]
  if len(pool) > k:  # down to the k-th best's value, those tied with it included (ties go by id)
    kept = values >= np.partition(values, len(values) - k)[len(values) - k]
    pool, values = pool[kept], values[kept]
  return pool[np.argsort(-values, kind="stable")[:k]]


def draw_then_check(params: SamplingParams) -> bool:
  """Whether a constrained row may first draw from its unmasked distribution and keep the token when the grammar
  allows it. Without top-k, top-p or min-p, keeping an allowed draw and otherwise drawing again from the masked
  logits gives exactly the masked distribution (greedy: the masked argmax); with them the cut would differ, so such
  rows, and rows that report logprobs, draw from the masked logits at once."""
  return params.top_k == 0 and params.top_p >= 1.0 and params.min_p <= 0.0 and params.logprobs is None


def allowed(masks: np.ndarray, tokens: np.ndarray) -> np.ndarray:
  """For each bitmask row (int32 words, bit i of word w = token 32 w + i) whether its token is allowed."""
  tokens = np.asarray(tokens, dtype=np.int64)
  inside = tokens < masks.shape[1] * 32
  words = masks[np.arange(len(tokens)), np.minimum(tokens >> 5, masks.shape[1] - 1)].astype(np.int64)
  return inside & (((words >> (tokens & 31)) & 1) == 1)


def masked(rows: np.ndarray, masks: np.ndarray) -> np.ndarray:
  """Logit rows with every token the bitmask rows do not allow set to -inf (tokens past the mask too)."""
  rows = np.asarray(rows, dtype=np.float32)
  bits = np.unpackbits(np.ascontiguousarray(masks).view(np.uint8), axis=1, bitorder="little").astype(bool)
  width = rows.shape[1]
  bits = bits[:, :width] if bits.shape[1] >= width else np.pad(bits, ((0, 0), (0, width - bits.shape[1])))
  return np.where(bits, rows, np.float32(-np.inf))


def sample_last(x: np.ndarray, temp: float = 0.0, top_p: float = 1.0, generator: Optional[np.random.Generator] = None) -> np.ndarray:
  """The engines' `sample(x, temp, top_p)`: sample the last position of logits (1, L, vocab) -> array([[id]])."""
  last = np.asarray(x)[:, -1, :] if np.ndim(x) == 3 else np.asarray(x).reshape(1, -1)
  params = [SamplingParams(temperature=float(temp), top_p=float(top_p))] * last.shape[0]
  gens: List[np.random.Generator] = [generator or make_generator(None)] * last.shape[0]
  return sample_rows(last, params, gens).reshape(-1, 1)

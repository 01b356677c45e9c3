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


# Most of a distribution's mass sits in a few hundred tokens: look there first, then among eight times as many, and
# sort the whole vocabulary only for rows whose kept set (top-k, top-p, min-p) might reach beyond those.
CANDIDATES = 512
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
  rest = np.nonzero(~whole)[0]
  for n in sorted({min(CANDIDATES, vocab), min(8 * CANDIDATES, vocab), vocab}):  # a row whose kept set may reach past n looks again
    if not len(rest):
      break
    drawn = np.empty(len(rest), dtype=np.int64)
    short = _sample_candidates(rows[rest], temps[rest], top_k[rest], top_p[rest], min_p[rest], full_mass[rest], n,
                               generators, [sampled[i] for i in rest], drawn)
    picks[rest[~short]] = drawn[~short]
    rest = rest[short]
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


def _sample_candidates(rows, temps, top_k, top_p, min_p, full_mass, n, generators, gen_index, picks) -> np.ndarray:
  """Sample each row among its `n` best tokens (ties by id), unless the kept set might extend past them: those rows
  draw nothing and are returned as True, so that a row's result never depends on how many candidates were looked at."""
  vocab = rows.shape[-1]
  cand = np.argpartition(-rows, n - 1, axis=-1)[:, :n] if n < vocab else np.broadcast_to(np.arange(vocab), rows.shape)
  cand = np.sort(cand, axis=-1)  # ties in the logits go to the lower id, as a full stable sort would
  order = np.argsort(-np.take_along_axis(rows, cand, axis=-1), axis=-1, kind="stable")
  cand = np.take_along_axis(cand, order, axis=-1)
  scaled = np.take_along_axis(rows, cand, axis=-1) / temps
  weights = np.exp(scaled - scaled[:, :1])  # relative to the row's best token, like full_mass
  rank = np.arange(n)[None, :]
  weights = np.where((top_k[:, None] <= 0) | (rank < top_k[:, None]), weights, 0.0)
  cum = np.cumsum(weights, axis=-1)
  with_k = top_k[:, None] > 0
  mass = np.where(with_k & (top_k[:, None] <= n), cum[:, -1:], full_mass)
  keep = weights >= min_p * weights[:, :1]
  keep &= cum - weights < top_p * mass  # top-p: the smallest prefix whose mass reaches top_p
  keep[:, 0] = True
  # Complete only if the kept set ends before the last candidate (or every token is a candidate).
  short = keep[:, -1] & (weights[:, -1] > 0) if n < vocab else np.zeros(len(rows), dtype=bool)
  if n < vocab and with_k.any():
    short |= (with_k[:, 0] & (top_k > n))
  probs = np.where(keep, weights, 0.0)
  cdf = np.cumsum(probs, axis=-1)
  for r in np.nonzero(~short)[0]:
    u = generators[gen_index[r]].random() * cdf[r, -1]
    picks[r] = cand[r, min(int((cdf[r] <= u).sum()), n - 1)]
  return short


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
  best = np.sort(np.argpartition(-scaled, k - 1, axis=-1)[:, :k], axis=-1) if k else np.zeros((len(wanted), 0), dtype=np.int64)
  best = np.take_along_axis(best, np.argsort(-np.take_along_axis(scaled, best, axis=-1), axis=-1, kind="stable"), axis=-1)
  # A token a grammar rules out has -inf: reported as OpenAI reports impossible tokens, -9999 (JSON has no infinity).
  best_logprobs = np.clip(np.take_along_axis(scaled, best, axis=-1) - log_total, IMPOSSIBLE_LOGPROB, 0.0)
  chosen = np.clip(scaled[np.arange(len(wanted)), [int(tokens[i]) for i in wanted]] - log_total[:, 0], IMPOSSIBLE_LOGPROB, 0.0)
  for row, i in enumerate(wanted):
    n = params[i].logprobs
    out[i] = TokenLogprobs(float(chosen[row]), [(int(t), float(lp)) for t, lp in zip(best[row, :n], best_logprobs[row, :n])])
  return out


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

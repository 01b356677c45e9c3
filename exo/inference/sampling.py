"""Vectorised sampling shared by every engine: one call for many rows, each with its own parameters."""
from dataclasses import asdict, dataclass, fields
from typing import List, Optional, Sequence

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

  def to_dict(self) -> dict:
    return asdict(self)

  @staticmethod
  def from_dict(data: dict) -> "SamplingParams":
    known = {f.name for f in fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in data.items() if k in known})


def make_generator(seed: Optional[int]) -> np.random.Generator:
  """A request's own random stream, so its tokens do not depend on who shares its batch."""
  return np.random.Generator(np.random.PCG64(seed))


def sample_rows(logits: np.ndarray, params: Sequence[SamplingParams], generators: Sequence[np.random.Generator]) -> np.ndarray:
  """Sample one token per row of `logits` (N, vocab); returns int64 ids (N,)."""
  logits = np.asarray(logits, dtype=np.float32).reshape(len(params), -1)
  tokens = np.argmax(logits, axis=-1).astype(np.int64)
  sampled = [i for i, p in enumerate(params) if p.temperature > 0]
  if not sampled:
    return tokens
  rows = logits[sampled]
  temps = np.array([params[i].temperature for i in sampled], dtype=np.float32)[:, None]
  top_k = np.array([params[i].top_k for i in sampled])
  top_p = np.array([params[i].top_p for i in sampled], dtype=np.float32)[:, None]
  min_p = np.array([params[i].min_p for i in sampled], dtype=np.float32)[:, None]

  # Only the best k candidates can survive any filter; sort just those.
  vocab = rows.shape[-1]
  k = int(top_k.max()) if (top_k > 0).all() else vocab
  k = min(k, vocab)
  if k < vocab:
    cand = np.argpartition(-rows, k - 1, axis=-1)[:, :k]
  else:
    cand = np.broadcast_to(np.arange(vocab), rows.shape)
  cand_logits = np.take_along_axis(rows, cand, axis=-1)
  order = np.argsort(-cand_logits, axis=-1, kind="stable")
  cand = np.take_along_axis(cand, order, axis=-1)
  scaled = np.take_along_axis(cand_logits, order, axis=-1) / temps
  # Unnormalised weights with each row's own top-k applied first (then top-p renormalises over those); every sum
  # is a prefix sum along the sorted row, so a row's result does not depend on how many candidates other rows needed.
  weights = np.exp(scaled - scaled[:, :1])
  rank = np.arange(weights.shape[-1])[None, :]
  weights = np.where((top_k[:, None] <= 0) | (rank < top_k[:, None]), weights, 0.0)
  cum = np.cumsum(weights, axis=-1)
  keep = weights >= min_p * weights[:, :1]
  # top-p: keep the smallest prefix whose mass reaches top_p (the first token always stays).
  keep &= cum - weights < top_p * cum[:, -1:]
  keep[:, 0] = True
  probs = np.where(keep, weights, 0.0)
  cdf = np.cumsum(probs, axis=-1)
  u = np.array([generators[i].random() for i in sampled], dtype=np.float64)[:, None] * cdf[:, -1:]
  pick = np.minimum((cdf <= u).sum(axis=-1), probs.shape[-1] - 1)
  tokens[sampled] = cand[np.arange(len(sampled)), pick]
  return tokens


def sample_last(x: np.ndarray, temp: float = 0.0, top_p: float = 1.0, generator: Optional[np.random.Generator] = None) -> np.ndarray:
  """The engines' `sample(x, temp, top_p)`: sample the last position of logits (1, L, vocab) -> array([[id]])."""
  last = np.asarray(x)[:, -1, :] if np.ndim(x) == 3 else np.asarray(x).reshape(1, -1)
  params = [SamplingParams(temperature=float(temp), top_p=float(top_p))] * last.shape[0]
  gens: List[np.random.Generator] = [generator or make_generator(None)] * last.shape[0]
  return sample_rows(last, params, gens).reshape(-1, 1)

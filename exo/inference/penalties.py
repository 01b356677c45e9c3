"""The logit processors a request may ask for, applied to a batch's rows in one vectorised pass before sampling:

- `frequency_penalty` f and `presence_penalty` p (OpenAI's): a token counted c > 0 times loses c * f + p;
- `repetition_penalty` r (Hugging Face's and vLLM's): a token the prompt or the answer holds has its logit divided by
  r where positive, multiplied by r where not;
- `logit_bias` (token id -> bias, OpenAI's): added; -100 bans the token outright;
- `min_tokens`: the model's end tokens are banned until the answer holds that many.

Without a `penalty_window` the answer's tokens are counted (and the prompt's, for repetition_penalty), as OpenAI and
vLLM count them; with a window n (Ollama's repeat_last_n) the last n tokens of the prompt and the answer together,
for every penalty, as llama.cpp counts them (0: none).
The prompt's tokens come with the parameters (`penalty_prompt`), so the node that samples needs nothing else.

Each request keeps a `TokenCounts` of what it has written, updated by one token a step; a step gathers the counted
tokens of every row that asks, changes those logits and no others."""
from collections import deque
from dataclasses import replace
from typing import Collection, List, Optional, Sequence, Tuple

import numpy as np

from exo.inference.sampling import SamplingParams, last_rows

BAN = -100.0  # a logit_bias this low bans the token
MAX_LOGIT_BIAS = 1024  # tokens one request may bias
MAX_PENALTY_PROMPT = 262_144  # prompt tokens sent for penalties to count (beyond any context this fork runs)
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0


def penalty_prompt(params: SamplingParams, prompt: Sequence[int]) -> Tuple[int, ...]:
  """The prompt's tokens the request's penalties count (sent with its parameters to the node that samples it)."""
  if params.penalty_window is not None:
    wanted = params.penalty_window if params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0 else 0
  else:
    wanted = len(prompt) if params.repetition_penalty != 1.0 else 0
  wanted = min(wanted, MAX_PENALTY_PROMPT)
  return tuple(int(t) for t in prompt[len(prompt) - wanted:]) if wanted else ()


def processes(params: SamplingParams) -> bool:
  """Whether a request's logits are changed before sampling."""
  return bool(params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0 or params.logit_bias or params.min_tokens)


class TokenCounts:
  """The tokens a request's penalties count, as arrays a step gathers at once: `ids` (every token seen, in order of
  first sight), `counted` (its occurrences for frequency and presence) and `present` (its occurrences for
  repetition), the first `size` entries of each. Without a window: the answer's tokens for the first, the prompt's
  (`penalty_prompt`) and the answer's for the second; with one, the last `window` tokens of both, for both."""

  def __init__(self, params: SamplingParams):
    self.window = params.penalty_window
    self.written = 0
    self.size = 0
    self.ids = np.zeros(64, dtype=np.int64)
    self.counted = np.zeros(64, dtype=np.float32)
    self.present = np.zeros(64, dtype=np.float32)
    self._index: dict = {}  # token -> its entry
    self._last: deque = deque()  # the window's tokens, oldest first
    prompt = [int(t) for t in params.penalty_prompt]
    for token in prompt[-self.window:] if self.window else ([] if self.window == 0 else prompt):
      self._add(token, counted=self.window is not None)

  def _entry(self, token: int) -> int:
    at = self._index.get(token)
    if at is None:
      if self.size == len(self.ids):
        self.ids, self.counted, self.present = (np.concatenate([a, np.zeros_like(a)]) for a in (self.ids, self.counted, self.present))
      at = self._index[token] = self.size
      self.ids[at] = token
      self.size += 1
    return at

  def _add(self, token: int, counted: bool) -> None:
    at = self._entry(token)
    self.present[at] += 1
    self.counted[at] += counted
    if self.window:
      self._last.append((at, counted))
      if len(self._last) > self.window:
        old, was_counted = self._last.popleft()
        self.present[old] -= 1
        self.counted[old] -= was_counted

  def add(self, token: int) -> None:
    self.written += 1
    if self.window != 0:
      self._add(int(token), counted=True)


def apply(rows: np.ndarray, params: Sequence[SamplingParams], counts: Sequence[Optional[TokenCounts]], end_tokens: Collection[int]) -> np.ndarray:
  """`rows` (N, vocab, float32) with each row's processors applied, in place (rows whose request asks for none
  unchanged); returns it. `counts[i]` is row i's TokenCounts (None for rows that ask for nothing); `end_tokens` the
  model's end tokens."""
  out = rows
  vocab = out.shape[1]
  penalised = [i for i, (p, c) in enumerate(zip(params, counts))
               if c is not None and c.size and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)]
  if penalised:
    which = np.concatenate([np.full(counts[i].size, i) for i in penalised])
    tokens = np.concatenate([counts[i].ids[:counts[i].size] for i in penalised])
    counted = np.concatenate([counts[i].counted[:counts[i].size] for i in penalised])
    present = np.concatenate([counts[i].present[:counts[i].size] for i in penalised]) > 0
    keep = (tokens < vocab) & (present | (counted > 0))
    which, tokens, counted, present = which[keep], tokens[keep], counted[keep], present[keep]
    repetition = np.array([p.repetition_penalty for p in params], dtype=np.float32)[which]
    frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)[which]
    presence = np.array([p.presence_penalty for p in params], dtype=np.float32)[which]
    values = out[which, tokens]
    values = np.where(present, np.where(values > 0, values / repetition, values * repetition), values)
    values = values - counted * frequency - (counted > 0) * presence
    out[which, tokens] = values
  for i, p in enumerate(params):
    for token, bias in p.logit_bias:
      if 0 <= token < vocab:
        out[i, token] = -np.inf if bias <= BAN else out[i, token] + bias
    if p.min_tokens and counts[i] is not None and counts[i].written < p.min_tokens:
      ends = [t for t in end_tokens if 0 <= t < vocab]
      out[i, ends] = -np.inf
  return out


def counts_for(request) -> Optional[TokenCounts]:
  """A request's TokenCounts (exo/orchestration/requests.py's record), made on first use; None if it asks for none."""
  if not processes(request.params):
    return None
  sampling = request.sampled_here()
  if sampling.penalty_counts is None:
    sampling.penalty_counts = TokenCounts(request.params)
    for token in sampling.tokens:
      sampling.penalty_counts.add(token)
  return sampling.penalty_counts


def rows_to_sample(results: Sequence[np.ndarray], requests: Sequence, end_tokens: Collection[int]) -> List[np.ndarray]:
  """Each request's logits as they are to be sampled: processed where it asks (its last position, (1, vocab)), as
  they came otherwise."""
  asking = [i for i, r in enumerate(requests) if processes(r.params)]
  if not asking:
    return list(results)
  # A grammar decides where a constrained answer ends: min_tokens does not hold it open.
  params = [replace(requests[i].params, min_tokens=0) if requests[i].params.grammar else requests[i].params for i in asking]
  rows = last_rows([results[i] for i in asking]).astype(np.float32, copy=False)  # a new array: the engine's logits stay as they were
  processed = apply(rows, params, [counts_for(requests[i]) for i in asking], end_tokens)
  out = list(results)
  for row, i in enumerate(asking):
    out[i] = processed[row:row + 1]
  return out

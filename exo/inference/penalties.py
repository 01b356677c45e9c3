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
  """The tokens a request's penalties count: `counted` (token -> occurrences) for frequency and presence, `present`
  (token -> occurrences) for repetition. Without a window: the answer's tokens for the first, the prompt's
  (`penalty_prompt`) and the answer's for the second; with one, the last `window` tokens of both, for both."""

  def __init__(self, params: SamplingParams):
    self.window = params.penalty_window
    self.counted: dict = {}
    self.present: dict = {}
    self.written = 0
    self._last: deque = deque()  # the window's tokens, oldest first
    prompt = [int(t) for t in params.penalty_prompt]
    for token in prompt[-self.window:] if self.window else ([] if self.window == 0 else prompt):
      self._add(token, counted=self.window is not None)

  def _add(self, token: int, counted: bool) -> None:
    self.present[token] = self.present.get(token, 0) + 1
    if counted:
      self.counted[token] = self.counted.get(token, 0) + 1
    if self.window:
      self._last.append(token)
      if len(self._last) > self.window:
        old = self._last.popleft()
        for counts in (self.present, self.counted):
          counts[old] -= 1
          if not counts[old]:
            del counts[old]

  def add(self, token: int) -> None:
    self.written += 1
    if self.window != 0:
      self._add(int(token), counted=True)


def apply(rows: np.ndarray, params: Sequence[SamplingParams], counts: Sequence[Optional[TokenCounts]], end_tokens: Collection[int]) -> np.ndarray:
  """`rows` (N, vocab) with each row's processors applied (a new array; rows whose request asks for none unchanged).
  `counts[i]` is row i's TokenCounts (None for rows that ask for nothing); `end_tokens` the model's end tokens."""
  out = np.array(rows, dtype=np.float32, copy=True)
  vocab = out.shape[1]
  which, tokens, answer_counts = [], [], []
  for i, (p, c) in enumerate(zip(params, counts)):
    if c is None or not (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0):
      continue
    seen = sorted(c.present)
    which += [i] * len(seen)
    tokens += seen
    answer_counts += [c.counted.get(t, 0) for t in seen]
  if which:
    which, tokens = np.array(which), np.array(tokens)
    keep = tokens < vocab
    which, tokens = which[keep], tokens[keep]
    answer_counts = np.array(answer_counts, dtype=np.float32)[keep]
    repetition = np.array([p.repetition_penalty for p in params], dtype=np.float32)[which]
    frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)[which]
    presence = np.array([p.presence_penalty for p in params], dtype=np.float32)[which]
    values = out[which, tokens]
    values = np.where(values > 0, values / repetition, values * repetition)  # every gathered token is present
    values = values - answer_counts * frequency - (answer_counts > 0) * presence
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
  if request.penalty_counts is None:
    request.penalty_counts = TokenCounts(request.params)
    for token in request.tokens:
      request.penalty_counts.add(token)
  return request.penalty_counts


def rows_to_sample(results: Sequence[np.ndarray], requests: Sequence, end_tokens: Collection[int]) -> List[np.ndarray]:
  """Each request's logits as they are to be sampled: processed where it asks (its last position, (1, vocab)), as
  they came otherwise."""
  asking = [i for i, r in enumerate(requests) if processes(r.params)]
  if not asking:
    return list(results)
  # A grammar decides where a constrained answer ends: min_tokens does not hold it open.
  params = [replace(requests[i].params, min_tokens=0) if requests[i].params.grammar else requests[i].params for i in asking]
  processed = apply(last_rows([results[i] for i in asking]), params, [counts_for(requests[i]) for i in asking], end_tokens)
  out = list(results)
  for row, i in enumerate(asking):
    out[i] = processed[row:row + 1]
  return out

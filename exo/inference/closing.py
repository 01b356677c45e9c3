"""Closing a constrained answer within its token budget: when the tokens left (max_tokens, or the context) come down
to what the grammar needs to be complete, the answer is closed the shortest way found, so it parses and matches its
schema instead of stopping mid-string.

`plan` finds a way to close from a matcher's state: the tokens the grammar forces, else the first allowed of a few
closing tokens (in a string, a quote and what may follow it; outside one, a reasoning model's `</think>` (gpt-oss's `<|end|>`), a brace or
bracket, then a comma, then the smallest values: 0, "", [], {}, null, false), else the allowed token with the shortest text. Where a string
stands is read by exo/inference/json_numbers.py's lexer. It is greedy, not a search, so it may miss a shorter way in
an odd grammar, but every token it takes is one the grammar allows.

`within_budget` runs at each step for the rows near their budget: the token drawn is kept when a way to close still
fits after it; otherwise the row takes the next token of its plan instead. The answer so goes on as the model
wants until its budget is down to the closing, which usually ends it at its budget or a few tokens before."""
from typing import Dict, List, Optional, Sequence

import numpy as np

from exo.inference.json_numbers import ESCAPE, STRING, NumberBounds, State

# Inside a string only a quote can close anything (a brace there is text). Outside one: a brace or bracket, else a
# comma (a number or value ends there, and required keys follow it), else the smallest value.
IN_STRING = ('"}}', '"}]', '"}', '"]', '"')
# A reasoning model's closing tag comes first: inside its thinking (free text) every other closer would be more
# thinking, and after it no grammar allows the tag. gpt-oss's thinking (harmony's analysis message) ends at `<|end|>`.
CLOSING_MARKERS = ("</think>", "<|end|>")  # special tokens that close something
OUTSIDE = CLOSING_MARKERS + ('}}', ']}', '}]', ']]', '}', ']', ',', ', ', '0', '""', '[]', '{}', 'null', 'false', 'true')
MAX_PLAN = 256  # tokens: a plan longer than this is not looked for
WATCH = 16  # tokens of margin over the last plan's length within which a row's every draw is checked
REPLAN_EVERY = 32  # tokens between two plans of a row further from its budget (the plan's length moves as the answer grows)
LOOK_AGAIN = 4  # a row with no way to close in time is looked at again after a quarter of what it has left (at least this, at most REPLAN_EVERY)


class ClosingTokens:
  """One vocabulary's closing tokens, in the order `plan` tries them."""

  def __init__(self, token_texts: Sequence[str]):
    by_text: Dict[str, int] = {}
    for i, text in enumerate(token_texts):
      if text and text not in by_text:
        by_text[text] = i
    self.in_string = np.array([by_text[t] for t in IN_STRING if t in by_text], dtype=np.int64)
    self.outside = np.array([by_text[t] for t in OUTSIDE if t in by_text], dtype=np.int64)
    lengths = np.array([len(t) if t else 1 << 30 for t in token_texts])
    self.shortest = np.argsort(lengths, kind="stable")[:int((lengths < 1 << 30).sum())]


def _allowed(bitmask: bytes, tokens: np.ndarray) -> np.ndarray:
  bits = np.frombuffer(bitmask, dtype=np.uint8)
  tokens = tokens[tokens < len(bits) * 8]
  return tokens[(bits[tokens >> 3] >> (tokens & 7)) & 1 == 1]


def plan(matcher, closing: ClosingTokens, lexer: NumberBounds, state: State, limit: int = MAX_PLAN) -> Optional[List[int]]:
  """Tokens that take a copy of `matcher`, whose answer's lexer stands at `state`, to a state the grammar accepts
  (none if it already does); None if no way of at most `limit` tokens was found. Call on the grammar threads."""
  m = matcher.deep_copy()
  out: List[int] = []
  while not (m.is_accepting() or m.is_stopped()):
    if m.is_error() or len(out) >= limit:
      return None
    forced = m.compute_ff_tokens()
    if forced:
      if m.try_consume_tokens(forced) != len(forced):
        return None
      out += forced
      for token in forced:
        state = lexer.advance(state, token)
      continue
    bitmask = m.compute_bitmask()
    pick = _allowed(bitmask, closing.in_string if state[0] in (STRING, ESCAPE) else closing.outside)
    if not len(pick):
      pick = _allowed(bitmask, closing.shortest[:4096])  # the shortest texts are single characters: the first few thousand do
    if not len(pick):
      pick = _allowed(bitmask, closing.shortest)
    if not len(pick) or not m.consume_token(int(pick[0])):
      return None
    out.append(int(pick[0]))
    state = lexer.advance(state, int(pick[0]))
  return out[:limit] if len(out) <= limit else None


class Budget:
  """One constrained request's closing state: the last plan's length and when it was made, whether the last look
  found no way to close within the budget at all, and the plan it follows while its draws do not fit."""

  def __init__(self) -> None:
    self.estimate: Optional[int] = None
    self.planned_at = 0
    self.steps = 0
    self.unreachable = False
    self.following: Optional[List[int]] = None

  def watching(self, left: int) -> bool:
    if self.following:
      return True
    if self.estimate is None or self.steps - self.planned_at >= REPLAN_EVERY:
      return True
    if self.unreachable:
      return self.steps - self.planned_at >= min(REPLAN_EVERY, max(LOOK_AGAIN, left // 4))
    return left <= self.estimate + WATCH


def within_budget(matcher, budget: Budget, closing: ClosingTokens, lexer: NumberBounds, state: State, token: int, left: Optional[int]) -> int:
  """The token this row takes: `token`, unless after it no way to close would fit in the `left` - 1 tokens that would
  remain; then the next token of the way to close found from here (kept, and followed while draws do not fit). Call
  on the grammar threads. A row with no way to close within its budget is looked at again some tokens later (the
answer may have written what its grammar still needed)."""
  budget.steps += 1
  if left is None or left <= 0 or not budget.watching(left):
    return token
  budget.planned_at = budget.steps
  if budget.estimate is None or budget.unreachable:  # first look, or a look again: is there a way to close at all?
    budget.following = plan(matcher, closing, lexer, state, min(MAX_PLAN, left))
    budget.unreachable = budget.following is None
    if budget.unreachable:
      budget.estimate = left
      return token
  after = matcher.deep_copy()
  if after.consume_token(int(token)):
    rest = plan(after, closing, lexer, lexer.advance(state, int(token)), min(MAX_PLAN, left - 1))
    if rest is not None:
      budget.estimate, budget.unreachable, budget.following = len(rest) + 1, False, None
      return token
  if not budget.following:
    budget.following = plan(matcher, closing, lexer, state, min(MAX_PLAN, left))
    if budget.following is None:  # no way to close within what is left: the draw stands
      budget.estimate, budget.unreachable = left, True
      return token
    if not budget.following:  # the grammar accepts here already
      return token
  return budget.following.pop(0)

"""Bounds on the JSON numbers a constrained answer writes, which JSON Schema cannot state and the grammar engine does
not impose: at most MAX_DIGITS significant digits (what a double or a 64-bit integer carries), at most
MAX_LEADING_ZEROS zeros before them (0.000001; smaller values take an exponent) and an exponent of at most
MAX_EXPONENT_DIGITS digits. Without them a small model at temperature 0 writes `1000000...` until its budget is
gone.

The bounds act on the sampler's grammar mask: each constrained answer's text is followed by a small JSON lexer
(`NumberState`, advanced token by token), and where it stands in a number, the tokens that would break a bound, or
leave a number that can only go on with a digit it may no longer write, are taken out of the mask. Which tokens that
is depends only on the lexer's state, so each state's list is computed once per vocabulary."""
from typing import Dict, List, Sequence, Tuple

import numpy as np

MAX_DIGITS = 17
MAX_LEADING_ZEROS = 6
MAX_EXPONENT_DIGITS = 3

# Lexer modes
OUTSIDE, STRING, ESCAPE, INTEGER, POINT, FRACTION, EXPONENT_SIGN, EXPONENT = range(8)
NUMBER_MODES = (INTEGER, POINT, FRACTION, EXPONENT_SIGN, EXPONENT)
DIGITS = "0123456789"

State = Tuple[int, int, int, int]  # (mode, significant digits, leading zeros, exponent digits)
START: State = (OUTSIDE, 0, 0, 0)


def step(state: State, char: str) -> State:
  """The lexer's state after one character of the answer."""
  mode, digits, zeros, exponent = state
  if mode == STRING:
    return (ESCAPE if char == "\\" else OUTSIDE if char == '"' else STRING, 0, 0, 0)
  if mode == ESCAPE:
    return (STRING, 0, 0, 0)
  if char in DIGITS:
    if mode in (OUTSIDE, INTEGER, POINT, FRACTION):
      if mode == OUTSIDE:
        digits = zeros = exponent = 0
      significant = digits > 0 or char != "0"
      return (INTEGER if mode in (OUTSIDE, INTEGER) else FRACTION, digits + significant, zeros + (not significant), 0)
    return (EXPONENT, digits, zeros, exponent + 1)
  if mode == INTEGER and char == ".":
    return (POINT, digits, zeros, 0)
  if mode in (INTEGER, FRACTION) and char in "eE":
    return (EXPONENT_SIGN, digits, zeros, 0)
  if mode == EXPONENT_SIGN and char in "+-":
    return state
  if mode == OUTSIDE and char == "-":
    return (INTEGER, 0, 0, 0)
  if mode in NUMBER_MODES:  # the number has ended: the character is read outside it
    return step(START, char)
  return (STRING, 0, 0, 0) if char == '"' else START


def over(state: State) -> bool:
  """Whether a number has broken a bound, or stands after its point with no digit left to write."""
  mode, digits, zeros, exponent = state
  return (digits > MAX_DIGITS or zeros > MAX_LEADING_ZEROS or exponent > MAX_EXPONENT_DIGITS
          or (mode == POINT and digits >= MAX_DIGITS))


class NumberBounds:
  """One vocabulary's tables: which tokens each lexer state must not be followed by."""

  def __init__(self, token_texts: List[str], restarts: Sequence[int] = ()):
    self.texts = token_texts
    self.restarts = set(restarts)  # tokens after which the answer's JSON starts afresh (a reasoning model's </think>)
    # Only these tokens can break a bound: they hold a digit, or go on with a number already begun.
    self.with_digits = [i for i, t in enumerate(token_texts) if any(c in DIGITS for c in t)]
    self.continuing = [i for i, t in enumerate(token_texts) if t[:1] in (".", "e", "E", "+", "-") and not any(c in DIGITS for c in t)]
    self._banned: Dict[State, np.ndarray] = {}

  def advance(self, state: State, token: int) -> State:
    if token in self.restarts:  # what came before (thinking: free text, with any quotes) is not the JSON
      return START
    for char in self.texts[token]:
      state = step(state, char)
    return state

  def banned(self, state: State) -> np.ndarray:
    """The token ids that must not follow `state` (int64, often empty)."""
    found = self._banned.get(state)
    if found is None:
      if state[0] in (STRING, ESCAPE):  # only a token that ends the string and begins a number can matter
        candidates = [i for i in self.with_digits if '"' in self.texts[i]]
      else:
        candidates = self.with_digits + (self.continuing if state[0] in NUMBER_MODES else [])
      found = self._banned[state] = np.array([i for i in candidates if self._breaks(state, i)], dtype=np.int64)
    return found

  def _breaks(self, state: State, token: int) -> bool:
    for char in self.texts[token]:
      state = step(state, char)
      if over(state):
        return True
    return False


def clear_bits(mask: np.ndarray, tokens: np.ndarray) -> None:
  """Take `tokens` out of a bitmask row (int32 words, bit i of word w = token 32 w + i), in place."""
  tokens = tokens[tokens < mask.shape[0] * 32]
  if len(tokens):
    words = mask.view(np.uint32)
    np.bitwise_and.at(words, tokens >> 5, ~(np.uint32(1) << (tokens & 31).astype(np.uint32)))

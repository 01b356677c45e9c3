"""Structured output that ends: JSON numbers held to exo/inference/json_numbers.py's bounds and, when the token
budget comes down to what the grammar needs to close, the shortest way to close it (exo/inference/closing.py).
Driven by logits that want to go on for ever (a digit, a key, a letter), on SmolLM2's real vocabulary."""
import json

import numpy as np
import pytest

from exo.download.shard_files import embedded_model_path
from exo.inference import constrained, grammar, json_numbers
from exo.inference.grammar import Constraint
from exo.inference.sampling import SamplingParams, make_generator

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
  from exo.inference.tokenizers import tokenizer_from_gguf
  return tokenizer_from_gguf(embedded_model_path("HuggingFaceTB/SmolLM2-135M-Instruct"))


class Sampler:
  async def sample_batch(self, logits, params, generators):
    from exo.inference.sampling import last_rows, sample_rows
    return sample_rows(last_rows(logits), params, generators)


def favouring(tokenizer, texts, vocab):
  """Logits that rank the tokens of `texts` first, in that order, everything else far below."""
  row = np.full(vocab, -10.0, dtype=np.float32)
  for rank, text in enumerate(texts):
    for token in tokenizer.encode(text):
      row[token] = max(row[token], 10.0 - rank)
  return row[None, None, :]


async def run(tokenizer, schema, favoured, budget=None, steps=400, bounded=True):
  """Greedy answer of the schema's grammar, from fixed logits; (text, tokens) once the grammar is done or `steps` run out."""
  constraint = Constraint("start: " + grammar.json_fragment(schema), bounded)
  await constraint.prepare(tokenizer)
  logits = favouring(tokenizer, favoured, constraint.vocab_size)
  tokens = []
  while not constraint.finished and len(tokens) < steps:
    left = None if budget is None else budget - len(tokens)
    if left == 0:
      break
    drawn, _ = await constrained.sample(Sampler(), [logits], [SamplingParams()], [make_generator(0)], [constraint], budgets=[left])
    tokens.append(int(drawn[0]))
    constraint.advance(tokens[-1])
  return tokenizer.decode(tokens, skip_special_tokens=True), tokens


NUMBER = {"type": "object", "properties": {"name": {"type": "string"}, "population_millions": {"type": "number"}}, "required": ["name", "population_millions"]}


async def test_a_number_that_would_grow_for_ever_stops_at_its_digits(tokenizer):
  text, _ = await run(tokenizer, NUMBER, ['{"', "name", '":', ' "', "P", '",', ' "', "population", "_", "mill", "ions", "1", "0", "}"])
  value = json.loads(text)["population_millions"]
  digits = str(value).replace(".", "").replace("e+", "").lstrip("0")
  assert len(text) < 120 and float(value) >= 1e15, text
  assert sum(c.isdigit() for c in text.split(":")[-1]) <= json_numbers.MAX_DIGITS + json_numbers.MAX_EXPONENT_DIGITS + 1, text


async def test_fractions_zeros_and_exponents_are_bounded_too(tokenizer):
  for favoured in (["3", ".", "3"], ["0", ".", "0"], ["1", "e", "9"]):
    text, _ = await run(tokenizer, {"type": "number"}, favoured, steps=60)
    assert text and len(text) <= 30, (favoured, text)
    float(text)


async def test_a_schema_bound_beyond_them_lifts_them(tokenizer):
  wide = {"type": "integer", "minimum": 0, "maximum": 9 * 10**18}
  assert grammar.asks_for_wide_numbers({"properties": {"x": wide}}) and not grammar.asks_for_wide_numbers(NUMBER)
  text, _ = await run(tokenizer, wide, ["1"], steps=60, bounded=False)
  assert text == "1" * 19  # more digits than the bounds allow, as many as the schema's maximum does


def test_the_lexer_leaves_strings_alone():
  bounds = json_numbers.NumberBounds(['"', "1", "a", ".", ": "])
  state = json_numbers.START
  for token in [0] + [1] * 30 + [0, 4]:  # thirty digits inside a string, then a value begins
    state = bounds.advance(state, token)
  assert state[0] == json_numbers.OUTSIDE and 1 not in bounds.banned(state)
  for _ in range(json_numbers.MAX_DIGITS):
    assert 1 not in bounds.banned(state)
    state = bounds.advance(state, 1)
  assert set(bounds.banned(state)) == {1, 3}  # no 18th digit, and no point it could not follow with a digit


FACTS = {"type": "object", "properties": {"city": {"type": "string"}, "facts": {"type": "array", "items": {"type": "object", "properties": {
  "name": {"type": "string"}, "value": {"type": "string"}}, "required": ["name", "value"]}}, "count": {"type": "integer"}}, "required": ["city", "facts", "count"]}


@pytest.mark.parametrize("schema", [{"type": "object"}, FACTS], ids=["json_object", "nested"])
@pytest.mark.parametrize("budget", [24, 48, 96])
async def test_an_answer_that_would_not_end_is_closed_within_its_budget(tokenizer, schema, budget):
  # Logits that never want to stop: another key, another item, another word.
  text, tokens = await run(tokenizer, schema, ['{"', "city", '":', ' "', "official", "_", "language", '",', ' "', "name", "count", "1", "[{", "},"],
                           budget=budget)
  assert len(tokens) <= budget
  value = json.loads(text)
  import jsonschema
  jsonschema.validate(value, schema)


async def test_the_plan_is_the_grammars_own_and_short(tokenizer):
  constraint = Constraint("start: " + grammar.json_fragment(FACTS))
  await constraint.prepare(tokenizer)
  for token in tokenizer.encode('{"city": "Par'):
    constraint.advance(token)
  from exo.inference.closing import plan
  tokens = plan(constraint.matcher, constraint.closing, constraint.lexer, constraint.lexer_state)
  closed = '{"city": "Par' + tokenizer.decode(tokens)
  assert json.loads(closed) == {"city": "Par", "facts": [], "count": 0}
  assert len(tokens) <= 16, tokenizer.decode(tokens)  # the forced keys come a few characters a token


async def test_an_answer_that_cannot_close_in_time_is_left_as_drawn_and_rarely_looked_at(tokenizer, monkeypatch):
  from exo.inference import closing
  long = {"type": "array", "minItems": 400, "items": {"type": "integer"}}
  favoured = ["[", "1", ", "]
  free, _ = await run(tokenizer, long, favoured, steps=40)
  looks = []
  original = closing.plan
  monkeypatch.setattr(closing, "plan", lambda *a, **k: looks.append(1) or original(*a, **k))
  budgeted, tokens = await run(tokenizer, long, favoured, budget=40)
  assert budgeted == free and len(tokens) == 40
  assert len(looks) <= 40 // 3  # not at every step: a quarter of what is left apart, at least LOOK_AGAIN

"""The logit processors (exo/inference/penalties.py) against references written here token by token from their
definitions: OpenAI's frequency and presence penalties, Hugging Face's repetition penalty, logit_bias with -100 as a
ban, min_tokens; in one batch with rows that ask for nothing (left as they are), and with Ollama's window."""
import numpy as np
import pytest

from exo.inference import penalties
from exo.inference.penalties import TokenCounts, apply
from exo.inference.sampling import SamplingParams

pytestmark = pytest.mark.unit

VOCAB = 40
END = {39}


def reference(logits, params: SamplingParams, prompt, answer):
  """One row, by the definitions: every token counted in turn."""
  out = [float(x) for x in logits]
  counted_prompt = list(prompt)
  counted_answer = list(answer)
  if params.penalty_window is not None:
    window = (counted_prompt + counted_answer)[-params.penalty_window:] if params.penalty_window else []
    counted_prompt, counted_answer = [], window  # a window counts prompt and answer alike, for every penalty
  for token in range(VOCAB):
    if token in counted_prompt or token in counted_answer:  # Hugging Face: divide a positive logit, multiply a negative one
      out[token] = out[token] / params.repetition_penalty if out[token] > 0 else out[token] * params.repetition_penalty
    c = counted_answer.count(token)  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
    out[token] -= c * params.frequency_penalty + (c > 0) * params.presence_penalty
  for token, bias in params.logit_bias:
    out[token] = -np.inf if bias == -100 else out[token] + bias
  if len(answer) < params.min_tokens:
    for token in END:
      out[token] = -np.inf
  return np.array(out, dtype=np.float32)


ROWS = [
  SamplingParams(),  # asks for nothing
  SamplingParams(frequency_penalty=0.7, presence_penalty=0.4),
  SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0),
  SamplingParams(repetition_penalty=1.3),
  SamplingParams(repetition_penalty=0.8, frequency_penalty=1.5),
  SamplingParams(logit_bias=((3, -100.0), (5, 7.5), (38, -2.0))),
  SamplingParams(min_tokens=12, presence_penalty=2.0),
  SamplingParams(repetition_penalty=1.2, frequency_penalty=0.3, penalty_window=6),
  SamplingParams(repetition_penalty=1.2, penalty_window=0),
]


def test_each_row_equals_its_reference_in_one_batch():
  rng = np.random.default_rng(0)
  logits = rng.normal(0, 3, (len(ROWS), VOCAB)).astype(np.float32)
  prompts = [list(rng.integers(0, VOCAB, 12)) for _ in ROWS]
  answers = [list(rng.integers(0, VOCAB, 7)) + [5, 5, 5] for _ in ROWS]
  params = [SamplingParams(**{**p.__dict__, "penalty_prompt": penalties.penalty_prompt(p, prompts[i])}) for i, p in enumerate(ROWS)]
  counts = []
  for p, answer in zip(params, answers):
    c = TokenCounts(p) if penalties.processes(p) else None
    for token in answer:
      if c is not None:
        c.add(token)
    counts.append(c)
  out = apply(logits.copy(), params, counts, END)
  for i, p in enumerate(params):
    np.testing.assert_allclose(out[i], reference(logits[i], p, prompts[i] if p.repetition_penalty != 1 or p.penalty_window else [], answers[i]),
                               rtol=1e-6, err_msg=f"row {i}: {ROWS[i]}")
  np.testing.assert_array_equal(out[0], logits[0])  # a row that asks for nothing is untouched
  assert out[5, 3] == -np.inf and out[6, 39] == -np.inf and np.isfinite(out[1, 39])


def test_only_the_prompt_tokens_a_penalty_counts_are_sent():
  prompt = list(range(30))
  assert penalties.penalty_prompt(SamplingParams(frequency_penalty=1.0), prompt) == ()  # OpenAI's count the answer only
  assert penalties.penalty_prompt(SamplingParams(repetition_penalty=1.1), prompt) == tuple(prompt)
  assert penalties.penalty_prompt(SamplingParams(repetition_penalty=1.1, penalty_window=4), prompt) == (26, 27, 28, 29)
  assert penalties.penalty_prompt(SamplingParams(penalty_window=4), prompt) == ()  # no penalty asked


def test_a_window_forgets_what_leaves_it():
  counts = TokenCounts(SamplingParams(repetition_penalty=1.5, penalty_window=3, penalty_prompt=(1, 2, 3, 4)))

  def table(values):
    return {int(t): float(v) for t, v in zip(counts.ids[:counts.size], values[:counts.size]) if v}
  assert table(counts.present) == {2: 1, 3: 1, 4: 1}
  counts.add(4)
  counts.add(9)
  assert table(counts.present) == {4: 2, 9: 1} and table(counts.counted) == {4: 2, 9: 1}


def test_params_travel_as_json_and_back():
  import json
  p = SamplingParams(logit_bias=((3, -100.0),), penalty_prompt=(1, 2), repetition_penalty=1.2, penalty_window=64, min_tokens=3)
  assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p
  from exo.orchestration import statuses
  assert statuses.sampling_params(json.loads(json.dumps(p.to_dict()))) == p
  for bad in ({"frequency_penalty": 5}, {"repetition_penalty": 0}, {"logit_bias": [[1, 500]]}, {"penalty_prompt": [-1]}, {"min_tokens": -1}):
    with pytest.raises(statuses.InvalidStatus):
      statuses.sampling_params({**p.to_dict(), **bad})

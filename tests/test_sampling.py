"""The shared vectorised sampler: each row its own parameters and random stream."""
import numpy as np
import pytest

from exo.inference.sampling import SamplingParams, make_generator, sample_last, sample_rows, token_logprobs

pytestmark = pytest.mark.unit

rng = np.random.default_rng(0)
LOGITS = rng.normal(size=(1, 500)).astype(np.float32) * 3


def draws(params, n=400, logits=LOGITS):
  gen = make_generator(params.seed if params.seed is not None else 1)
  return np.array([sample_rows(logits, [params], [gen])[0] for _ in range(n)])


def test_greedy_is_argmax():
  logits = rng.normal(size=(4, 100)).astype(np.float32)
  assert (sample_rows(logits, [SamplingParams()] * 4, [make_generator(0)] * 4) == logits.argmax(-1)).all()


def test_an_engines_greedy_batch_is_each_rows_last_position_argmax():
  import asyncio
  from exo.inference.inference_engine import InferenceEngine
  logits = [rng.normal(size=(1, length, 50)).astype(np.float32) for length in (1, 3, 1)]  # a prompt's last chunk among decode rows
  drawn = asyncio.run(InferenceEngine.sample_batch(None, logits, [SamplingParams()] * 3, [make_generator(0)] * 3))
  assert drawn.dtype == np.int64 and list(drawn) == [int(np.argmax(x[0, -1])) for x in logits]


def test_top_k_limits_candidates():
  top5 = set(np.argsort(-LOGITS[0])[:5])
  picked = set(draws(SamplingParams(temperature=5.0, top_k=5)))
  assert picked <= top5 and len(picked) > 1


def test_top_p_keeps_the_smallest_nucleus():
  probs = np.exp(LOGITS[0] - LOGITS[0].max())
  probs /= probs.sum()
  order = np.argsort(-probs)
  nucleus = set(order[:np.searchsorted(np.cumsum(probs[order]), 0.5) + 1])
  assert set(draws(SamplingParams(temperature=1.0, top_p=0.5))) <= nucleus


def test_min_p_drops_unlikely_tokens():
  probs = np.exp(LOGITS[0] - LOGITS[0].max())
  allowed = set(np.nonzero(probs >= 0.2)[0])
  assert set(draws(SamplingParams(temperature=1.0, min_p=0.2))) <= allowed


def test_temperature_spreads_the_distribution():
  assert len(set(draws(SamplingParams(temperature=3.0)))) > len(set(draws(SamplingParams(temperature=0.3))))


def test_seeded_rows_do_not_depend_on_batch_composition():
  logits = rng.normal(size=(3, 300)).astype(np.float32)
  p = SamplingParams(temperature=1.0, seed=42)
  alone = [sample_rows(logits[1:2], [p], [g])[0] for g in [make_generator(42)] for _ in range(5)]
  gens = [make_generator(1), make_generator(42), make_generator(7)]
  params = [SamplingParams(temperature=0.5, top_k=3, seed=1), p, SamplingParams()]
  batched = [sample_rows(logits, params, gens)[1] for _ in range(5)]
  assert alone == batched


def test_sample_last_uses_the_last_position():
  x = np.zeros((1, 3, 10), dtype=np.float32)
  x[0, 0, 1] = x[0, -1, 7] = 10
  assert sample_last(x).item() == 7


def test_looking_among_the_best_tokens_samples_exactly_as_sorting_everything(monkeypatch):
  import exo.inference.sampling as sampling
  rng = np.random.default_rng(5)
  logits = (rng.normal(size=(12, 5000)) * rng.uniform(0.5, 6, size=(12, 1))).astype(np.float32)
  logits[3, :40] = logits[3, 40]  # ties
  params = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m, seed=i)
            for i, (t, p, k, m) in enumerate([(1.0, 1.0, 0, 0.0), (0.7, 0.9, 0, 0.0), (1.5, 0.95, 0, 0.05), (1.0, 0.5, 0, 0.0),
                                              (2.0, 1.0, 50, 0.0), (1.0, 0.8, 1000, 0.0), (0.3, 1.0, 0, 0.1), (1.2, 0.99, 0, 0.0),
                                              (1.0, 1.0, 0, 0.0), (0.0, 1.0, 0, 0.0), (1.0, 0.6, 3, 0.0), (1.9, 0.999, 0, 0.0)])]

  def run(floors):
    monkeypatch.setattr(sampling, "WEIGHT_FLOORS", floors)
    gens = [make_generator(p.seed) for p in params]
    return np.stack([sample_rows(logits, params, gens) for _ in range(30)])

  assert (run((0.5, 1e-3)) == run(())).all()  # high floors (few candidates, often too few) against none


def test_a_temperature_alone_draws_from_the_softmax_over_the_whole_vocabulary():
  # A row that keeps every token draws without sorting (block by block): its frequencies are still the softmax's.
  logits = np.random.default_rng(1).normal(size=(1, 700)).astype(np.float32) * 1.5
  expected = np.exp(logits[0] / 0.8 - (logits[0] / 0.8).max())
  expected /= expected.sum()
  picked = draws(SamplingParams(temperature=0.8, seed=3), n=40000, logits=logits)
  frequencies = np.bincount(picked, minlength=700) / len(picked)
  assert 0.5 * np.abs(frequencies - expected).sum() < 0.05  # total variation (sampling noise here is ~0.03)


def test_a_temperature_alone_never_draws_a_token_of_weight_zero():
  logits = np.full((1, 3000), -np.inf, dtype=np.float32)  # as a grammar's mask leaves a row
  allowed = [0, 255, 256, 1999, 2999]
  logits[0, allowed] = [1.0, 0.5, 2.0, 0.1, 3.0]
  assert set(draws(SamplingParams(temperature=2.0), n=3000, logits=logits)) == set(allowed)


def test_top_k_beyond_the_vocabulary_keeps_every_token():
  picked = draws(SamplingParams(temperature=5.0, top_k=10**6))
  assert picked.min() >= 0 and picked.max() < LOGITS.shape[1] and len(set(picked)) > 50


def log_softmax(row, temperature):
  scaled = np.asarray(row, dtype=np.float64) / (temperature if temperature > 0 else 1.0)
  return scaled - scaled.max() - np.log(np.exp(scaled - scaled.max()).sum())


def test_token_logprobs_are_the_log_softmax_each_row_was_sampled_from():
  rng = np.random.default_rng(7)
  logits = rng.normal(size=(4, 300)).astype(np.float32) * 3
  params = [SamplingParams(logprobs=3), SamplingParams(), SamplingParams(temperature=0.5, logprobs=0), SamplingParams(temperature=1.7, logprobs=20)]
  tokens = [int(np.argmax(logits[0])), 5, 17, 250]
  out = token_logprobs(logits, params, tokens)
  assert out[1] is None and out[2].top == []
  for row, (p, lp) in enumerate(zip(params, out)):
    if lp is None:
      continue
    expected = log_softmax(logits[row], p.temperature)
    assert abs(lp.logprob - expected[tokens[row]]) < 1e-4 and lp.logprob <= 0
    assert [t for t, _ in lp.top] == list(np.argsort(-expected, kind="stable")[:p.logprobs])
    assert all(abs(v - expected[t]) < 1e-4 and v <= 0 for t, v in lp.top)
  assert out[0].top[0][0] == tokens[0] and out[0].top[0][1] == out[0].logprob  # greedy: the token is top-1


def test_token_logprobs_best_tokens_go_by_value_then_id_and_masked_ones_come_last():
  row = np.full((1, 5000), -np.inf, dtype=np.float32)  # a grammar's mask leaves three tokens
  row[0, [4000, 7, 9]] = [2.0, 2.0, -30.0]  # (the third far below the others: beyond any window around the best)
  [lp] = token_logprobs(row, [SamplingParams(logprobs=5)], [7])
  assert [t for t, _ in lp.top] == [7, 4000, 9, 0, 1]
  assert lp.top[3][1] == -9999.0 and lp.top[0][1] == lp.top[1][1] == lp.logprob
  [lp] = token_logprobs(row, [SamplingParams(logprobs=0)], [9])  # the token's own logprob, no alternatives
  assert lp.top == [] and lp.logprob < -30


def test_temperature_sharpens_or_flattens_the_reported_distribution():
  row = np.random.default_rng(3).normal(size=(1, 50)).astype(np.float32)
  best = int(np.argmax(row))
  cold, plain, hot = (token_logprobs(row, [SamplingParams(temperature=t, logprobs=1)], [best])[0].logprob for t in (0.3, 0.0, 2.0))
  assert cold > plain > hot

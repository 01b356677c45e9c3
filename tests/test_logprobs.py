"""Logprobs inside a node: computed beside the sampling from the very logits each request was sampled from (batched
rows included), and joined at the origin with tokens sampled on another node (a token_logprobs status, then the
token's SendResult)."""
import asyncio
import json
from contextlib import aclosing

import numpy as np
import pytest

from exo.inference.sampling import SamplingParams, TokenLogprobs
from exo.orchestration import statuses
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.generation import generate_events
from tests.support.toy import TOY, ToyEngine, encode, make_node, settle, toy_logits

pytestmark = pytest.mark.unit


def logprobs_status(request_id: str, position: int, logprobs: TokenLogprobs) -> str:
  return statuses.TokenLogprobsStatus.build(request_id=request_id, position=position, logprob=logprobs.logprob, top=logprobs.top)


def expected_logprobs(history, token, temperature):
  scaled = toy_logits(history).astype(np.float64) / (temperature if temperature > 0 else 1.0)
  log_softmax = scaled - scaled.max() - np.log(np.exp(scaled - scaled.max()).sum())
  return log_softmax[token], list(np.argsort(-log_softmax, kind="stable"))


async def collect(node, prompt, params):
  tokens, logprobs = [], []
  async with aclosing(generate_events(node, TOY, prompt, params, timeout=60)) as events:
    async for event in events:
      tokens += event.tokens
      logprobs += event.logprobs or [None] * len(event.tokens)
  return tokens, logprobs


@pytest.mark.asyncio
async def test_batched_rows_each_get_the_logprobs_of_their_own_logits():
  node, plugin = make_node(ToyEngine(), BatchingConfig(batch_size=8, timeout_ms=20))
  await node.start()
  asks = [("alpha", SamplingParams(max_tokens=6, logprobs=3)), ("bravo", SamplingParams(max_tokens=6)),
          ("charlie", SamplingParams(temperature=0.8, seed=4, max_tokens=6, logprobs=5)), ("delta", SamplingParams(temperature=1.5, seed=9, max_tokens=6, logprobs=0))]
  try:
    results = await asyncio.gather(*[collect(node, prompt, params) for prompt, params in asks])
    assert plugin.node.step_core.sampling_stats.mean > 1  # the rows were sampled together
  finally:
    await settle(node)
  for (prompt, params), (tokens, logprobs) in zip(asks, results):
    assert tokens
    if params.logprobs is None:
      assert logprobs == [None] * len(tokens)
      continue
    history = list(encode(prompt))
    for token, lp in zip(tokens, logprobs):
      chosen, order = expected_logprobs(history, token, params.temperature)
      assert abs(lp.logprob - chosen) < 1e-4 and lp.logprob <= 0
      assert [t for t, _ in lp.top] == order[:params.logprobs]
      if params.temperature == 0:
        assert lp.top[0][0] == token
      history.append(token)


@pytest.mark.asyncio
async def test_the_origin_joins_a_peers_logprobs_with_its_tokens():
  """The sampling node sends each token's logprobs as a status just before the token's SendResult; the origin pairs
  them by position, and drops what it did not ask for or what runs too far ahead."""
  node, _ = make_node(ToyEngine())
  await node.start()
  try:
    await node.lifecycle.start_request("r1", SamplingParams(logprobs=1))
    watcher = node.lifecycle.watch("r1")
    first, second = TokenLogprobs(-0.5, [(7, -0.5)]), TokenLogprobs(-0.25, [(9, -0.25)])
    node.receive_status("r1", logprobs_status("r1", 0, first))
    node.receive_status("r1", logprobs_status("r1", 500, second))  # too far ahead: ignored
    node.receive_status("r1", json.dumps({"type": "token_logprobs", "request_id": "r1", "position": 1, "logprob": 0.5, "top": []}))  # invalid
    node.receive_status("r1", logprobs_status("r1", 1, TokenLogprobs(-0.1, [(1, -0.1), (2, -0.2)])))  # more than asked for
    node.on_result("r1", [7], False)
    node.receive_status("r1", logprobs_status("r1", 1, second))
    node.on_result("r1", [9], False)
    node.on_result("r1", [3], True)
    events = [watcher.get_nowait() for _ in range(3)]
    assert [e.logprobs for e in events] == [[first], [second], [None]]
    assert node.requests.get("r1") is None  # the last token ended it here
  finally:
    await settle(node)


def test_a_token_logprobs_status_is_checked_before_anything_uses_it():
  good = logprobs_status("r", 3, TokenLogprobs(-1.0, [(4, -1.0), (2, -2.0)]))
  kind, status = statuses.parse(good)
  assert kind == statuses.TOKEN_LOGPROBS and status.logprobs == TokenLogprobs(-1.0, [(4, -1.0), (2, -2.0)])
  base = json.loads(good)
  for change in ({"position": -1}, {"position": "3"}, {"logprob": 0.1}, {"logprob": float("nan")}, {"top": [[4, 1.0]]}, {"top": [[-4, -1.0]]},
                 {"top": [[4]]}, {"top": [[i, -1.0] for i in range(21)]}, {"request_id": ""}):
    with pytest.raises(statuses.InvalidStatus):
      statuses.parse(json.dumps({**base, **change}))
  with pytest.raises(statuses.InvalidStatus):
    statuses.sampling_params({"logprobs": 21})
  assert statuses.sampling_params({"logprobs": 20}).logprobs == 20

"""/metrics in Prometheus text: it parses with prometheus_client's own parser, and its counters, histograms and
gauges move as real requests are served (dummy engine, batching on; the real SmolLM2's KV gauge: test_api_limits.py)."""
import asyncio

import aiohttp
import pytest

from exo.orchestration.batching.config import BatchingConfig
from tests.support.api_server import ApiServer, SlowEngine, scrape

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hello"}]


async def post(url, body):
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{url}/v1/chat/completions", json=body) as r:
      return r.status, await r.text()


@pytest.mark.asyncio
async def test_counters_and_histograms_move_as_requests_are_served():
  s = ApiServer(SlowEngine(delay=0.01), batching=BatchingConfig(4)).start()
  try:
    before = await scrape(s.url)
    assert before[("exo_requests_running", ())] == 0 and before[("exo_requests_waiting", ())] == 0
    assert before[("exo_requests_rejected_total", ())] == 0 and before[("exo_batch_size_count", ())] == 0
    results = await asyncio.gather(*[post(s.url, {"messages": USER, "stream": i % 2 == 0}) for i in range(4)])
    assert [status for status, _ in results] == [200] * 4
    assert (await post(s.url, {"messages": USER, "top_k": -1}))[0] == 400
    assert (await post(s.url, {"messages": USER, "best_of": 2}))[0] == 400
    after = await scrape(s.url)
  finally:
    s.stop()
  moved = {key: after[key] - before.get(key, 0) for key in after}
  assert moved[("exo_prompt_tokens_total", ())] == 4  # the dummy prompt is one token
  assert moved[("exo_generation_tokens_total", ())] == 40
  assert moved[("exo_time_to_first_token_seconds_count", ())] == 4
  assert moved[("exo_inter_token_latency_seconds_count", ())] == 36
  assert moved[("exo_time_to_first_token_seconds_sum", ())] > 0
  assert moved[("exo_errors_total", (("kind", "invalid_request_error"),))] == 1
  assert moved[("exo_errors_total", (("kind", "unsupported_parameter"),))] == 1
  # Four requests through one engine: the batching plugin's steps held more than one of them at a time.
  steps, requests = moved[("exo_batch_size_count", ())], moved[("exo_batch_size_sum", ())]
  assert steps > 0 and requests == 40 and requests / steps > 1
  assert after[("exo_batch_size_bucket", (("le", "+Inf"),))] == steps
  # The bubble: this node's one stage (every layer) was busy for part of the time, and keeps one group in flight.
  assert moved[("exo_stage_busy_seconds_total", (("layers", "0-7"),))] > 0
  assert 0 < after[("exo_stage_busy_fraction", (("layers", "0-7"),))] <= 1
  assert after[("exo_micro_batches", (("layers", "0-7"),))] == 1

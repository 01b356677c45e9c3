"""Run-ahead on the real SmolLM2 through the HTTP API of one node (steps/ahead.py): a decoding request's next step
starts as soon as its token is sampled, and a greedy one's step after that is chained on the engine's thread
(inference/chained_steps.py). The answers are the same tokens as without it, and a request that ends
while a step runs ahead for it (its token limit, a stop string, its end of sequence, its client gone) gets no extra
token and leaves no KV cache behind."""
import asyncio
import threading
from typing import Optional

import numpy as np
import openai
import pytest

from exo.inference.chained_steps import Ticket
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.orchestration.batching.config import BatchingConfig
from tests.support.api_server import ApiServer
from tests.support.models import smollm2_shard
from tests.support.waiting import eventually

pytestmark = pytest.mark.model

MODEL = "smollm2-135m"
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]
CAPITAL = [{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]
BATCHING = {"unbatched": None, "batched": BatchingConfig(batch_size=4, timeout_ms=5, prefill_chunk=24)}


@pytest.fixture(scope="module")
def server():
  server = ApiServer("numpy", batching=BATCHING["batched"]).start()
  try:
    yield server
  finally:
    server.stop()


@pytest.fixture(scope="module", params=list(BATCHING))
def node_server(request):
  server = ApiServer("numpy", batching=BATCHING[request.param]).start()
  try:
    yield server
  finally:
    server.stop()


def client_of(server: ApiServer) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def streamed(server: ApiServer, messages, **body) -> tuple:
  """The streamed text, its content chunks, and the last chunk's finish reason."""
  text, chunks, reason = "", 0, None
  extra = {k: body.pop(k) for k in ("ignore_eos",) if k in body}
  for chunk in client_of(server).chat.completions.create(model=MODEL, messages=messages, stream=True, temperature=0, extra_body=extra, **body):
    if chunk.choices and chunk.choices[0].delta.content:
      text, chunks = text + chunk.choices[0].delta.content, chunks + 1
    if chunk.choices and chunk.choices[0].finish_reason:
      reason = chunk.choices[0].finish_reason
  return text, chunks, reason


def with_run_ahead(server: ApiServer, on: bool, ask, chained: Optional[list] = None):
  """`ask()` with run-ahead on or off on the server's node; returns its answer and the rows whose step ran ahead
  (and appends to `chained` the steps the engine chained)."""
  ahead = server.node.steps.ahead
  ahead.enabled, taken, chained_before = on, ahead.rows_taken, ahead.steps_chained
  try:
    return ask(), ahead.rows_taken - taken
  finally:
    ahead.enabled = True
    if chained is not None:
      chained.append(ahead.steps_chained - chained_before)


def holds_nothing(server: ApiServer) -> None:
  """Until the node holds no request, no KV cache and no step run ahead."""
  engine = server.node.inference_engine
  asyncio.run(eventually(lambda: not engine.caches and engine.kv_cache_bytes() == 0 and not server.node.steps.ahead.rows and not list(server.node.requests),
                         10, lambda: f"caches {list(engine.caches)}, ahead {list(server.node.steps.ahead.rows)}, requests {list(server.node.requests)}"))


def test_run_ahead_gives_the_same_tokens(node_server):
  ask = lambda: client_of(node_server).chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=40, extra_body={"ignore_eos": True})
  chained = []
  (off, off_ahead), (on, on_ahead) = with_run_ahead(node_server, False, ask), with_run_ahead(node_server, True, ask, chained)
  assert off_ahead == 0 and on_ahead >= 38  # every decode step but the first (after the prompt) and the last's would-be successor
  assert chained[0] > 0  # greedy: most of them chained on the engine's thread
  assert on.choices[0].message.content == off.choices[0].message.content and on.usage.completion_tokens == off.usage.completion_tokens == 40
  holds_nothing(node_server)


def test_two_streams_at_once_get_the_same_tokens_with_and_without_run_ahead(server):
  def both():
    answers = [None, None]

    def ask(i, messages):
      answers[i] = streamed(server, messages, max_tokens=24, ignore_eos=True)[0]
    threads = [threading.Thread(target=ask, args=(i, m)) for i, m in enumerate((STORY, CAPITAL))]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)
    return answers
  (off, _), (on, on_ahead) = with_run_ahead(server, False, both), with_run_ahead(server, True, both)
  assert on == off and on_ahead > 0
  holds_nothing(server)


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_the_token_limit_mid_run_ahead_gives_no_extra_token_and_frees_the_cache(node_server, max_tokens):
  ask = lambda: streamed(node_server, STORY, max_tokens=max_tokens, ignore_eos=True)
  (off, _), ((text, chunks, reason), _) = with_run_ahead(node_server, False, ask), with_run_ahead(node_server, True, ask)
  assert (text, chunks, reason) == off and reason == "length"
  usage = client_of(node_server).chat.completions.create(model=MODEL, messages=STORY, temperature=0, max_tokens=max_tokens, extra_body={"ignore_eos": True}).usage
  assert usage.completion_tokens == max_tokens
  holds_nothing(node_server)


def test_a_stop_string_mid_run_ahead_cuts_the_answer_as_without_and_frees_the_cache(node_server):
  full, _, _ = streamed(node_server, STORY, max_tokens=48, ignore_eos=True)
  stop = full.split()[len(full.split()) // 2]  # a word from the middle: several steps ran ahead before it
  ask = lambda: streamed(node_server, STORY, max_tokens=48, ignore_eos=True, stop=[stop])
  (off, _), (on, on_ahead) = with_run_ahead(node_server, False, ask), with_run_ahead(node_server, True, ask)
  assert on == off and on[0] == full[:full.index(stop)] and on[2] == "stop" and on_ahead > 0
  holds_nothing(node_server)


def test_a_stream_that_joins_mid_run_ahead_and_a_sampled_one_get_the_same_tokens(server):
  """A second request arrives while the first's steps are chained (it must join the next step, and the chain stops);
  a sampled request (seeded) never chains: both answers as without run-ahead."""
  def joined():
    first, second = [], []
    started = threading.Event()

    def one():
      text = ""
      for n, chunk in enumerate(client_of(server).chat.completions.create(model=MODEL, messages=STORY, stream=True, temperature=0, max_tokens=40,
                                                                         extra_body={"ignore_eos": True})):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        if n == 8:
          started.set()
      first.append(text)

    def two():
      started.wait(60)
      second.append(client_of(server).chat.completions.create(model=MODEL, messages=CAPITAL, temperature=0.8, seed=7, max_tokens=24,
                                                              extra_body={"ignore_eos": True}).choices[0].message.content)
    threads = [threading.Thread(target=one), threading.Thread(target=two)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)
    return first + second
  off, _ = with_run_ahead(server, False, joined)
  on, on_ahead = with_run_ahead(server, True, joined)
  assert len(on) == 2 and on == off and on_ahead > 0
  holds_nothing(server)


def test_the_end_of_sequence_mid_run_ahead_ends_the_answer_as_without(node_server):
  ask = lambda: streamed(node_server, CAPITAL, max_tokens=200)
  (off, _), (on, _) = with_run_ahead(node_server, False, ask), with_run_ahead(node_server, True, ask)
  assert on == off and on[2] == "stop" and "Paris" in on[0]
  holds_nothing(node_server)


def test_a_client_gone_mid_run_ahead_leaves_no_cache(node_server):
  stream = client_of(node_server).chat.completions.create(model=MODEL, messages=STORY, stream=True, temperature=0, max_tokens=300,
                                                          extra_body={"ignore_eos": True})
  for n, _ in enumerate(stream):
    if n == 10:
      break
  stream.close()
  holds_nothing(node_server)


def test_a_step_run_ahead_for_a_request_without_a_cache_begins_none(downloader):
  """A request that ended (its cache dropped) before its step ran ahead: an error for its row, no new cache."""
  engine, shard = NumpyDynamicShardInferenceEngine(downloader), smollm2_shard()

  async def main():
    assert engine.start_ahead(shard, [("r", np.array([[1]]), None)]) is None  # nothing loaded: nothing starts
    await engine.infer_batch(shard, [("live", np.array([[1, 2, 3]]), None)])
    results = await engine.start_ahead(shard, [("live", np.array([[4]]), None), ("ended", np.array([[4]]), None)])
    assert results[0][0].shape == (1, 1, engine.model.config.vocab_size) and engine.caches["live"].length == 4
    assert isinstance(results[1], ValueError) and "ended" not in engine.caches
    await engine.finish_request("live")
    assert not engine.caches
  asyncio.run(main())


def test_a_granted_step_chains_the_greedy_token_unless_it_ends_the_request(downloader):
  """On the engine's thread: the step after a granted one runs with the argmax of its logits; a token that ends the
  request chains nothing; a request whose cache is gone by then gets an error and no cache."""
  engine, shard = NumpyDynamicShardInferenceEngine(downloader), smollm2_shard()

  async def main():
    await engine.infer_batch(shard, [("a", np.array([[1, 2, 3]]), None), ("b", np.array([[4, 5]]), None)])
    ticket = Ticket()
    assert ticket.grant({"a": frozenset(), "b": frozenset()})
    results = await engine.start_ahead(shard, [("a", np.array([[6]]), None), ("b", np.array([[6]]), None)], ticket)
    chained = ticket.chained
    assert not ticket.grant({"a": frozenset()})  # ended: too late to grant
    assert [int(t[0, 0]) for _, t, _ in chained.rows] == [int(np.argmax(r[0])) for r in results]
    following = await asyncio.wrap_future(chained.results)
    assert engine.caches["a"].length == 5 and engine.caches["b"].length == 4 and len(following) == 2 and chained.ticket.chained is None

    ends = Ticket()
    ends.grant({"a": frozenset(range(engine.model.config.vocab_size))})  # whatever its next token, it ends the request
    await engine.start_ahead(shard, [("a", np.array([[int(np.argmax(following[0][0]))]]), None)], ends)
    assert ends.chained is None and engine.caches["a"].length == 6

    gone = Ticket()
    gone.grant({"b": frozenset()})
    step = engine.start_ahead(shard, [("b", np.array([[int(np.argmax(following[1][0]))]]), None)], gone)
    dropped = engine._start(engine._drop_cache, "b")  # (finish_request's call, queued in this turn: behind the step, before what it chains)
    await step
    await dropped
    assert isinstance((await asyncio.wrap_future(gone.chained.results))[0], ValueError) and "b" not in engine.caches
    await engine.finish_request("a")
    assert not engine.caches
  asyncio.run(main())

"""A request's life on the real SmolLM2, through the HTTP API of one node: a request for another model that has no
room beside the loaded one (here one model at a time) waits for the loaded one's requests instead of wiping them (and
a peer's prompt does not make the node preload that model meanwhile), and an error reported mid-prefill ends the
prefill within a chunk and frees its cache."""
import functools
import json
import threading
import time
import urllib.request

import openai
import pytest

from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.requests import Status
from tests.support.api_server import ApiServer, openai_client, shared_server
from tests.support.checkpoints import install_random_model
from tests.support.waiting import eventually

pytestmark = pytest.mark.model

STORY = "Write a long story about a lighthouse keeper and a storm."
STORY_TOKENS = 48


def stream_text(client: openai.OpenAI, model: str, content: str, max_tokens: int, on_chunk=lambda n: None) -> str:
  text, chunks = "", 0
  for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], stream=True, temperature=0,
                                              max_tokens=max_tokens, extra_body={"ignore_eos": True}):
    if chunk.choices and chunk.choices[0].delta.content:
      text += chunk.choices[0].delta.content
      chunks += 1
      on_chunk(chunks)
  return text


def state_of(server: ApiServer) -> dict:
  with urllib.request.urlopen(f"{server.url}/v1/state", timeout=10) as response:
    return json.loads(response.read())


BATCHING = {"unbatched": None, "batched": BatchingConfig(batch_size=8, timeout_ms=5, prefill_chunk=24)}


@pytest.fixture(scope="module", params=list(BATCHING))
def smol_server(request, tmp_path_factory):
  """A node with SmolLM2 and, in its EXO_HOME, a random-weight stand-in for llama-3.2-1b (16 layers)."""
  home = tmp_path_factory.mktemp("exo_home")
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("EXO_HOME", str(home))
    install_random_model("llama-3.2-1b")
    server = ApiServer("numpy", batching=BATCHING[request.param]).start()
    server.node.model_pool.max_models = 1  # one model at a time (EXO_MAX_LOADED_MODELS=1): another waits for the loaded one's requests
    try:
      yield server
    finally:
      server.stop()


@functools.lru_cache(maxsize=None)
def solo_story() -> str:
  return stream_text(openai_client(shared_server("numpy")), "smollm2-135m", STORY, STORY_TOKENS)


async def test_a_request_for_another_model_waits_and_changes_nobody_elses_answer(smol_server):
  solo = solo_story()
  other, started, first_done = {}, threading.Event(), []

  def ask_other_model():
    reply = openai_client(smol_server).chat.completions.create(model="llama-3.2-1b", messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    other.update(reply=reply, at=time.monotonic())

  asker = threading.Thread(target=ask_other_model)

  def on_chunk(n):
    if n == 4:  # a peer starts a prompt for the other model: this node must not preload it now
      status = {"type": "node_status", "node_id": "a-peer", "status": "start_process_prompt", "request_id": "elsewhere",
                "shard": {"model_id": "llama-3.2-1b", "start_layer": 0, "end_layer": 15, "n_layers": 16}}
      smol_server.loop.call_soon_threadsafe(smol_server.node.on_node_status, "elsewhere", json.dumps(status))
    if n == 8:
      asker.start()
      started.set()

  text = stream_text(openai_client(smol_server), "smollm2-135m", STORY, STORY_TOKENS, on_chunk)
  first_done.append(time.monotonic())
  assert started.is_set()
  asker.join(120)
  assert text == solo
  assert other["reply"].usage.completion_tokens == 8 and other["at"] > first_done[0]
  await eventually(lambda: state_of(smol_server)["requests"] == [] and state_of(smol_server)["kv_bytes"] == 0, 10, "no request left")
  # And back: the first model answers as before once the other's request has ended.
  assert stream_text(openai_client(smol_server), "smollm2-135m", STORY, STORY_TOKENS) == solo


async def test_an_error_mid_prefill_ends_the_prefill_and_frees_its_cache(smol_server):
  """A peer reports the request failed while its ~2,200-token prompt is being computed beside 4 running streams: the
  prompt stops within a chunk, its client gets the error at once, and nothing of it stays behind."""
  client = openai_client(smol_server)
  streams = [threading.Thread(target=stream_text, args=(client, "smollm2-135m", f"Count slowly from {i}.", 60)) for i in range(4)]
  for thread in streams:
    thread.start()
  await eventually(lambda: sum(r["status"] == "decoding" for r in state_of(smol_server)["requests"]) == 4, 60, "4 streams decoding")
  outcome = {}

  def long_prompt():
    try:
      stream_text(client, "smollm2-135m", "Summarise this: " + "the quick brown fox jumps over the lazy dog " * 240, 16)
      outcome["error"] = None
    except openai.APIStatusError as e:
      outcome["error"], outcome["at"] = e.response.text, time.monotonic()

  asker = threading.Thread(target=long_prompt)
  asker.start()
  victim = await eventually(lambda: next((r["id"] for r in state_of(smol_server)["requests"] if r["status"] == "prefilling"), None), 60,
                            "the long prompt prefilling")
  failed_at = time.monotonic()
  error = json.dumps({"type": "request_error", "request_id": victim, "error": "the next node ran out of memory"})
  smol_server.loop.call_soon_threadsafe(smol_server.node.receive_status, victim, error)
  asker.join(60)
  assert outcome["error"] is not None and "ran out of memory" in outcome["error"]
  assert outcome["at"] - failed_at < 3, outcome["at"] - failed_at
  assert victim not in {r["id"] for r in state_of(smol_server)["requests"]}
  for thread in streams:
    thread.join(120)
  await eventually(lambda: state_of(smol_server)["requests"] == [] and state_of(smol_server)["kv_bytes"] == 0, 10, "nothing left")
  assert smol_server.node.requests.ended(victim) is Status.FAILED

"""Two chat models and an embedding model loaded at once on one real node, through its HTTP API: the embedded
SmolLM2 and a random-weight Llama in llama-3.2-1b's place (each on its own numpy engine), and all-MiniLM-L6-v2.
Requests for both chat models run side by side (each engine step holds one model's rows, the models take turns),
each loaded once, each answering the greedy tokens it answers served alone; /api/ps, /v1/models and /v1/state show all
three with when they loaded and when they expire; Ollama's keep_alive 0 unloads one. (The pool's rules on the dummy
engine and a fake clock: test_model_pool.py.)"""
import asyncio

import aiohttp
import ollama
import openai
import pytest

from exo.orchestration.batching.config import BatchingConfig
from tests.support.api_server import ApiServer, scrape
from tests.support.checkpoints import install_random_model

pytestmark = pytest.mark.model

SMOL, LLAMA, EMBEDDER = "smollm2-135m", "llama-3.2-1b", "all-minilm-l6-v2"
PROMPTS = ["Name three colours.", "Count to five.", "What is a river?"]
TOKENS = 12
BATCHING = BatchingConfig(batch_size=8, timeout_ms=5, prefill_chunk=24)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
  """(a node holding both chat models, a node serving one model at a time: the reference)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv("EXO_HOME", str(tmp_path_factory.mktemp("exo_home")))
    install_random_model(LLAMA)
    several, alone = ApiServer("numpy", batching=BATCHING).start(), ApiServer("numpy", batching=BATCHING).start()
    alone.node.model_pool.max_models = 1
    try:
      yield several, alone
    finally:
      several.stop()
      alone.stop()


async def ask(server: ApiServer, model: str, prompt: str) -> str:
  client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="exo", timeout=180, max_retries=0)
  reply = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
  assert reply.usage.completion_tokens == TOKENS
  return reply.choices[0].message.content


async def get(server: ApiServer, path: str) -> dict:
  async with aiohttp.ClientSession() as session:
    async with session.get(f"{server.url}{path}") as response:
      return await response.json()


class StepLog:
  """Every engine step of the node's step loop: its model, its rows' models, and the models of the live requests."""

  def __init__(self, server: ApiServer):
    self.steps, self.node = [], server.node
    loop = server.node.steps
    finishing_for = loop.finishing_for

    def recording(scheduler, step):
      models = {r.model for r in self.node.requests if r.model is not None}
      self.steps.append((scheduler.shard.model_id, {self.node.requests.get(row.request_id).model for row, _ in step.rows}, models))
      return finishing_for(scheduler, step)
    loop.finishing_for = recording


async def test_two_chat_models_and_an_embedding_model_are_served_side_by_side_each_loaded_once(servers):
  several, alone = servers
  expected = {(model, prompt): await ask(alone, model, prompt) for model in (SMOL, LLAMA) for prompt in PROMPTS}
  assert [m["model"] for m in alone.node.model_pool.describe()] == [LLAMA]  # one at a time: the reference switched
  log = StepLog(several)
  embedder = ollama.AsyncClient(host=several.url, timeout=180)
  for _ in range(2):  # requests for both models, alternating, all in flight together, and embeddings beside them
    asked = [(model, prompt) for prompt in PROMPTS for model in (SMOL, LLAMA)]
    answers = await asyncio.gather(*[ask(several, model, prompt) for model, prompt in asked], embedder.embed(model="all-minilm", input=PROMPTS))
    assert dict(zip(asked, answers[:-1])) == expected
    assert len(answers[-1].embeddings) == len(PROMPTS)

  pool = several.node.model_pool
  assert pool.loads == 2 and several.api.core.embeddings.pool.loads == 1  # nothing loaded twice
  assert pool.engines[SMOL] is not pool.engines[LLAMA] and several.node.inference_engine in (pool.engines[SMOL], pool.engines[LLAMA])
  assert all(rows == {model} for model, rows, _ in log.steps), "an engine step held one model's rows only"
  assert any(live == {SMOL, LLAMA} for _, _, live in log.steps), "both models' requests ran at once"
  turns = [model for model, _, _ in log.steps]
  assert sum(a != b for a, b in zip(turns, turns[1:])) >= 4, turns

  ps = (await embedder.ps()).models
  assert sorted(m.model for m in ps[:2]) == [f"{LLAMA}:latest", f"{SMOL}:latest"] and ps[2].model == f"{EMBEDDER}:latest"  # chat models first
  own = next(model for model in (SMOL, LLAMA) if pool.engines[model] is several.node.inference_engine)
  other = LLAMA if own == SMOL else SMOL
  # each until its keep-alive runs out, but the model on the node's own engine, kept
  assert {m.model: m.expires_at.year < 9999 for m in ps} == {f"{own}:latest": False, f"{other}:latest": True, f"{EMBEDDER}:latest": True}
  listed = {m["id"]: m for m in (await get(several, "/v1/models"))["data"]}
  assert listed[own]["expires_at"] is None and all(listed[m]["expires_at"] - listed[m]["loaded_at"] >= 299 for m in (other, EMBEDDER))
  assert "loaded_at" not in listed["llama-3.2-3b"]
  state = await get(several, "/v1/state")
  assert sorted((m["model"], m["requests"]) for m in state["models"]) == [(LLAMA, 0), (SMOL, 0)]
  assert [m["model"] for m in state["embedding_models"]] == [EMBEDDER] and state["kv_bytes"] == 0
  assert (await scrape(several.url))[("exo_loaded_models", ())] == 2

  await embedder.generate(model=LLAMA, prompt="", keep_alive=0)  # Ollama's way to unload a model
  assert [m.model for m in (await embedder.ps()).models] == [f"{SMOL}:latest", f"{EMBEDDER}:latest"]
  assert await ask(several, LLAMA, PROMPTS[0]) == expected[(LLAMA, PROMPTS[0])] and pool.loads == 3

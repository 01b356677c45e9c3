"""What every batch-capable engine must do on the real SmolLM2-135M: the checks, and `EngineChecks`, which an
engine's test module (tests/test_engines_<name>.py) inherits to run them on its engine."""
import asyncio
import functools
from typing import Dict, List, Optional

import numpy as np
import pytest

from exo.inference import llama_engine
from exo.inference import weights as weights_module
from tests.support.models import smollm2_shard

# The same forward computed two ways (one shard vs two, alone vs batched, engine vs engine) agrees to this absolute
# tolerance on the logits, which are O(10): float32 summation order differs between the ways.
LOGIT_ATOL = 2e-3
# An engine whose KV cache is float16 (numpy) rounds keys and values that the two ways made a last float32 bit apart
# to float16 values a unit apart now and then, and a float16 cache against a float32 one rounds every key: logits
# (O(10)) moved by up to 4.1e-3 cached against recomputed, 1.2e-2 numpy against tinygrad and MLX, 2.6e-2 kept
# quantized against dequantised (one logit of 1.2 million), and 5.1e-3 batched against alone (the step's threads
# make its sums' order vary from run to run). Greedy tokens stayed equal throughout.
FLOAT16_KV_LOGIT_ATOL = 5e-2


def logit_atol(engine, float32_atol: float = LOGIT_ATOL) -> float:
  """The tolerance for two ways of computing the same logits on this engine, as its KV cache's width allows."""
  return float32_atol if engine.kv_bytes_per_value(engine.model.config) >= 4 else FLOAT16_KV_LOGIT_ATOL

# Short plain-text openings (no chat template): different lengths, different continuations, cheap prefills.
OPENINGS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colours are",
            "Water is made of", "My favourite animal", "Two plus two is", "Shakespeare wrote"]


@functools.lru_cache(maxsize=None)
def cached_weights(path, shard, keep_quantized=False, quantize=None):
  """Reading the GGUF costs seconds; every engine in the session shares one read per shard (they only copy from it)."""
  return weights_module.load_shard_weights(path, shard, keep_quantized, quantize)


async def load_engine_async(cls, downloader, shard=None):
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(llama_engine, "load_shard_weights", cached_weights)
    engine = cls(downloader)
    await engine.ensure_shard(shard or smollm2_shard())
  return engine


def load_engine(cls, downloader, shard=None):
  return asyncio.run(load_engine_async(cls, downloader, shard))


def chat(engine, text: str) -> str:
  return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def prompt_ids(engine, texts, template: bool = False) -> List[np.ndarray]:
  return [np.array(engine.tokenizer.encode(chat(engine, t) if template else t), dtype=np.int64) for t in texts]


def argmax(logits: np.ndarray) -> int:
  return int(np.argmax(logits[0, -1]))


async def greedy(engine, request_id: str, ids: np.ndarray, n: int, stop_at_eos: bool = True) -> List[int]:
  """One request alone, token by token through infer_tensor."""
  shard = smollm2_shard()
  logits, _ = await engine.infer_tensor(request_id, shard, ids.reshape(1, -1))
  tokens = []
  for _ in range(n):
    tokens.append(argmax(logits))
    if len(tokens) == n or (stop_at_eos and tokens[-1] in engine.tokenizer.eos_token_ids):
      break
    logits, _ = await engine.infer_tensor(request_id, shard, np.array([[tokens[-1]]]))
  await engine.finish_request(request_id)
  return tokens


async def interleaved(engine, prompts: List[np.ndarray], n: int, tag: str) -> List[List[int]]:
  """All requests at once, each through infer_tensor, switching between them at every token."""
  async def one(i, ids):
    shard, request_id = smollm2_shard(), f"{tag}-{i}"
    logits, _ = await engine.infer_tensor(request_id, shard, ids.reshape(1, -1))
    tokens = []
    for _ in range(n):
      tokens.append(argmax(logits))
      if len(tokens) == n or tokens[-1] in engine.tokenizer.eos_token_ids:
        break
      await asyncio.sleep(0)
      logits, _ = await engine.infer_tensor(request_id, shard, np.array([[tokens[-1]]]))
    await engine.finish_request(request_id)
    return tokens
  return list(await asyncio.gather(*[one(i, ids) for i, ids in enumerate(prompts)]))


async def batched(engine, prompts: List[np.ndarray], n: int, tag: str, join_every: int = 1,
                  stop_at_eos: bool = True, first_logits: Dict[int, np.ndarray] = None) -> List[List[int]]:
  """All requests through infer_batch, one engine step per token; request i joins at step i // join_every, so with
  join_every > 0 steps mix prompts (prefill) and single decode tokens of other requests."""
  shard = smollm2_shard()
  tokens: List[List[int]] = [[] for _ in prompts]
  done = [False] * len(prompts)
  step = 0
  while not all(done):
    items, who = [], []
    for i, ids in enumerate(prompts):
      if done[i] or step < (i // join_every if join_every else 0):
        continue
      items.append((f"{tag}-{i}", ids.reshape(1, -1) if not tokens[i] else np.array([[tokens[i][-1]]]), {"i": i}))
      who.append(i)
    if items:
      for i, result in zip(who, await engine.infer_batch(shard, items)):
        assert not isinstance(result, Exception), result
        logits, state = result
        assert logits.shape == (1, 1, engine.model.config.vocab_size) and state == {"i": i}
        if first_logits is not None and not tokens[i]:
          first_logits[i] = logits[0, -1]
        tokens[i].append(argmax(logits))
        if len(tokens[i]) == n or (stop_at_eos and tokens[i][-1] in engine.tokenizer.eos_token_ids):
          done[i] = True
          await engine.finish_request(f"{tag}-{i}")
    step += 1
  return tokens


# --- the checks ---

async def check_greedy_answer(engine):
  ids = prompt_ids(engine, ["What is the capital of France?"], template=True)[0]
  tokens = await greedy(engine, "capital", ids, 12)
  assert engine.tokenizer.decode(tokens) == "The capital of France is Paris.<|im_end|>"


async def check_shapes_and_errors(engine):
  shard = smollm2_shard()
  assert isinstance(engine.device_name, str) and engine.device_name
  logits, state = await engine.infer_prompt("shapes", shard, "Hello there", {"keep": 1})
  assert logits.shape == (1, 1, 49152) and logits.dtype == np.float32 and state == {"keep": 1}
  sampled = await engine.sample(logits, temp=0.0)
  assert sampled.item() == argmax(logits)
  with pytest.raises(ValueError, match="out of range"):
    await engine.infer_tensor("bad", shard, np.array([[10**6]]))
  with pytest.raises(ValueError, match="token ids"):
    await engine.infer_tensor("bad", shard, np.zeros((1, 2, 576), dtype=np.float32))
  # one bad item fails alone; the others in its step still run
  results = await engine.infer_batch(shard, [("bad", np.array([[-1]]), None), ("shapes", np.array([[42]]), None)])
  assert isinstance(results[0], ValueError) and results[1][0].shape == (1, 1, 49152)
  assert "bad" not in engine.caches
  await engine.finish_request("shapes")
  assert engine.kv_cache_bytes() == 0


async def check_concurrent_match_alone(engine, n: int):
  """8 requests with different prompts, interleaved at token granularity, each give exactly their tokens alone."""
  prompts = prompt_ids(engine, OPENINGS)
  alone = [await greedy(engine, f"alone-{i}", ids, n) for i, ids in enumerate(prompts)]
  assert len(set(map(tuple, alone))) > 4, "the prompts should lead to different answers"
  assert engine.kv_cache_bytes() == 0
  assert await interleaved(engine, prompts, n, "mixed") == alone
  assert engine.kv_cache_bytes() == 0
  assert await batched(engine, prompts, n, "batch", join_every=0) == alone  # all prompts in one step, then decode
  assert await batched(engine, prompts, n, "join", join_every=4) == alone  # half the requests join a running batch
  assert engine.kv_cache_bytes() == 0


async def check_split_shards_match_whole(engine, cls, downloader, tag: str):
  """A shard split in two gives the whole model's logits, for the prompt and for the tokens after it."""
  first = await load_engine_async(cls, downloader, smollm2_shard(0, 13))
  second = await load_engine_async(cls, downloader, smollm2_shard(14, 29))
  assert len(first.model.layers) == 14 and len(second.model.layers) == 16, "a shard holds only its own layers"
  ids = prompt_ids(engine, ["What is 2 + 2?"], template=True)[0]
  x = ids.reshape(1, -1)
  for _ in range(3):
    whole, _ = await engine.infer_tensor(tag, smollm2_shard(), x)
    hidden, _ = await first.infer_tensor(tag, smollm2_shard(0, 13), x)
    assert hidden.shape == (1, x.shape[1], 576) and hidden.dtype == np.float32
    split, _ = await second.infer_tensor(tag, smollm2_shard(14, 29), hidden)
    assert split.shape == whole.shape == (1, 1, 49152)
    np.testing.assert_allclose(split, whole, atol=logit_atol(engine))
    x = np.array([[argmax(whole)]])
  for e in (engine, first, second):
    await e.finish_request(tag)
    assert e.kv_cache_bytes() == 0


async def check_cache_grows_not_preallocated(engine):
  """The cache starts small, grows past its first capacity as the request goes on, and stays exact doing so."""
  shard = smollm2_shard()
  ids = np.array(engine.tokenizer.encode("word " * 80), dtype=np.int64)[:72]
  await engine.infer_tensor("grow", shard, ids[None, :40])
  small = engine.kv_cache_bytes()
  assert 0 < small < 30 * 2 * 3 * 1024 * 64 * 4, "not sized to the 8192-token context"
  await engine.infer_tensor("grow", shard, ids[None, 40:70])  # crosses the first capacity
  await engine.infer_tensor("grow", shard, ids[None, 70:71])
  grown = engine.kv_cache_bytes()
  incremental, _ = await engine.infer_tensor("grow", shard, ids[None, 71:72])
  assert grown > small
  whole, _ = await engine.infer_tensor("grow-whole", shard, ids[None, :72])
  np.testing.assert_allclose(incremental, whole, atol=logit_atol(engine))
  await engine.finish_request("grow")
  await engine.finish_request("grow-whole")
  assert engine.kv_cache_bytes() == 0


async def check_prefix_copy_matches_computed(engine):
  """A prompt started from another's cached prefix (its first whole blocks) gives the logits of one computed whole,
  for its last position and for the token after, whether it takes over the ended request's cache or copies from a
  live one; once they end, the engine holds no live KV."""
  from exo.inference.prefix_cache import BLOCK, block_keys
  shard = smollm2_shard()
  first, second = prompt_ids(engine, ["Tell me about the sea and the wind over the harbour at night, in detail.",
                                      "Tell me about the sea and the wind over the harbour at dawn, briefly."], template=True)
  engine.prefixes.clear()
  await engine.infer_tensor("prefix-first", shard, first.reshape(1, -1))
  engine.remember_prefix("prefix-first", block_keys(shard.model_id, first))
  await engine.finish_request("prefix-first")  # the store alone keeps it now
  keys = block_keys(shard.model_id, second)
  reused = await engine.start_from_prefix("prefix-second", shard, keys, len(second) - 1)
  assert reused > 0 and reused % BLOCK == 0 and np.array_equal(first[:reused], second[:reused])
  cached, _ = await engine.infer_tensor("prefix-second", shard, second[None, reused:])
  whole, _ = await engine.infer_tensor("prefix-whole", shard, second[None, :])
  np.testing.assert_allclose(cached, whole, atol=logit_atol(engine))
  # The cache prefix-second took over is live now: a third request copies the prefix out of it.
  assert await engine.start_from_prefix("prefix-copy", shard, keys, len(second) - 1) == reused
  assert engine.caches["prefix-copy"] is not engine.caches["prefix-second"]
  copied, _ = await engine.infer_tensor("prefix-copy", shard, second[None, reused:])
  np.testing.assert_allclose(copied, whole, atol=logit_atol(engine))
  token = np.array([[argmax(whole)]])
  after_cached, _ = await engine.infer_tensor("prefix-second", shard, token)
  after_whole, _ = await engine.infer_tensor("prefix-whole", shard, token)
  np.testing.assert_allclose(after_cached, after_whole, atol=logit_atol(engine))
  assert argmax(after_cached) == argmax(after_whole)
  for request_id in ("prefix-second", "prefix-copy", "prefix-whole"):
    await engine.finish_request(request_id)
  assert engine.kv_cache_bytes() == 0 and engine.prefix_cache_bytes() > 0
  engine.prefixes.clear()


# Batched attention (every request's rows in one step) against each request run alone: the same logits to this
# absolute tolerance, and so the same greedy tokens.
BATCHED_ATOL = 2e-4


async def check_batched_logits_match_alone(engine, atol: Optional[float] = None, chunk: int = 16, decode: int = 5):
  """Requests of mixed lengths join a running batch one every other step, their prompts cut in chunks of `chunk`
  tokens (so prompt chunks share steps with other requests' decode rows), and decode `decode` tokens each, fed
  each request's own greedy tokens from its run alone: every logit row matches that run's within `atol` (default:
  logit_atol's for batched steps)."""
  atol = logit_atol(engine, BATCHED_ATOL) if atol is None else atol
  shard = smollm2_shard()
  long = "The history of the river valley begins with " + "farmers, traders and builders, " * 12
  prompts = prompt_ids(engine, OPENINGS[:5] + [long])
  assert max(map(len, prompts)) > 3 * chunk and min(map(len, prompts)) < chunk
  alone_logits, alone_tokens = [], []
  for i, ids in enumerate(prompts):
    logits, _ = await engine.infer_tensor(f"solo-{i}", shard, ids.reshape(1, -1))
    rows, tokens = [logits[0, -1]], []
    for _ in range(decode):
      tokens.append(argmax(logits))
      logits, _ = await engine.infer_tensor(f"solo-{i}", shard, np.array([[tokens[-1]]]))
      rows.append(logits[0, -1])
    await engine.finish_request(f"solo-{i}")
    alone_logits.append(rows)
    alone_tokens.append(tokens)

  fed = [0] * len(prompts)  # prompt tokens fed so far
  got: List[List[np.ndarray]] = [[] for _ in prompts]
  step = 0
  while any(len(rows) <= decode for rows in got):
    items, who = [], []
    for i, ids in enumerate(prompts):
      if step < 2 * i or len(got[i]) > decode:
        continue
      if fed[i] < len(ids):
        x = ids[fed[i]:fed[i] + chunk].reshape(1, -1)
        fed[i] += x.shape[1]
      else:
        x = np.array([[alone_tokens[i][len(got[i]) - 1]]])
      items.append((f"joined-{i}", x, None))
      who.append((i, fed[i] == len(ids)))  # a prompt's last chunk, or a decode token: its logits are compared
    for (i, compared), result in zip(who, await engine.infer_batch(shard, items)):
      assert not isinstance(result, Exception), result
      if compared:
        got[i].append(result[0][0, -1])
    step += 1
  for i in range(len(prompts)):
    await engine.finish_request(f"joined-{i}")
  assert engine.kv_cache_bytes() == 0
  for i in range(len(prompts)):
    for k, (row, want) in enumerate(zip(got[i], alone_logits[i])):
      np.testing.assert_allclose(row, want, atol=atol, rtol=0, err_msg=f"request {i}, logits {k}")
    assert [int(np.argmax(row)) for row in got[i][:decode]] == alone_tokens[i], "greedy tokens differ"


class EngineChecks:
  """The checks every engine passes. An engine's test module defines the `engine` and `engine_class` fixtures and
  a `Test...` class that inherits these (and may loosen `batched_atol` for an engine whose step pads its shapes)."""

  batched_atol = BATCHED_ATOL

  async def test_greedy_answer(self, engine):
    await check_greedy_answer(engine)

  async def test_shapes_and_errors(self, engine):
    await check_shapes_and_errors(engine)

  async def test_concurrent_requests_match_alone(self, engine):
    await check_concurrent_match_alone(engine, n=5)

  async def test_split_shards_match_whole(self, engine, engine_class, downloader):
    await check_split_shards_match_whole(engine, engine_class, downloader, "split")

  async def test_cache_grows_not_preallocated(self, engine):
    await check_cache_grows_not_preallocated(engine)

  async def test_batched_logits_match_alone(self, engine):
    await check_batched_logits_match_alone(engine, self.batched_atol)

  async def test_prefix_copy_matches_computed(self, engine):
    await check_prefix_copy_matches_computed(engine)

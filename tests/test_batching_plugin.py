"""The batching plugin on a real Node (a ring of one) with a toy engine whose steps and sampling really suspend,
which is what made upstream's batcher hang: many requests at random times all finish, outputs match unbatched,
each request gets its own sampling parameters, a bad row fails alone, stop() leaves nothing behind."""
import asyncio
import random
import textwrap
import time
import zlib
from argparse import Namespace
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np
import pytest

from exo.download.shard_download import NoopShardDownloader
from exo.inference.inference_engine import InferenceEngine
from exo.inference.sampling import SamplingParams, sample_last
from exo.inference.shard import Shard
from exo.networking.discovery import NoDiscovery
from exo.orchestration.batching.config import BatchingConfig, batching_config_from
from exo.orchestration.batching.plugin import PLUGIN_NAME, register_batching
from exo.orchestration.generation import GenerationError, generate
from exo.orchestration.node import Node
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy

TOY = Shard("toy", 0, 0, 4)  # base shard; a ring of one holds layers 0-3
VOCAB = 64
EOS = 0


class ToyEngine(InferenceEngine):
  """A deterministic toy language model. The logits at each position are a pseudo-random function of the request's
  tokens up to there (its own 'KV cache'), for every position of the input, so sampling the wrong position, the wrong
  row or the wrong request shows. Every step and every sampling call sleeps, so concurrent callers interleave."""

  def __init__(self, step_s: float = 0.002, sample_s: float = 0.002, slow: Optional[Dict[str, float]] = None, poison=(), broken=()):
    self.shard = None
    self.tokenizer = SimpleNamespace(eos_token_id=EOS, eos_token_ids={EOS})
    self.step_s, self.sample_s = step_s, sample_s
    self.slow = {tuple(encode(p)): s for p, s in (slow or {}).items()}  # prompt -> seconds its prompt step takes
    self.poison = {tuple(encode(p)) for p in poison}  # prompts whose decode logits are NaN
    self.broken = {tuple(encode(p)) for p in broken}  # prompts whose decode steps raise
    self.history: Dict[str, List[int]] = {}
    self.prompts: Dict[str, tuple] = {}
    self.batches: List[int] = []  # rows per infer_batch call

  async def encode(self, shard, prompt):
    return encode(prompt)

  async def decode(self, shard, tokens):
    return " ".join(map(str, np.asarray(tokens).reshape(-1)))

  async def ensure_shard(self, shard):
    self.shard = shard

  async def load_checkpoint(self, shard, path):
    self.shard = shard

  async def sample(self, x, temp=0.0, top_p=1.0):
    await asyncio.sleep(self.sample_s * random.random())
    return sample_last(x, temp, top_p)

  async def sample_batch(self, logits, params, generators):
    await asyncio.sleep(self.sample_s * random.random())
    if any(np.isnan(x).any() for x in logits):
      raise ValueError("NaN in logits")
    return await super().sample_batch(logits, params, generators)

  async def infer_batch(self, shard, items):
    self.batches.append(len(items))
    return await super().infer_batch(shard, items)

  async def infer_tensor(self, request_id, shard, input_data, inference_state=None):
    await self.ensure_shard(shard)
    ids = [int(t) for t in np.asarray(input_data).reshape(-1)]
    history = self.history.setdefault(request_id, [])
    prompt = self.prompts.setdefault(request_id, tuple(ids))  # a request's first input is its prompt
    await asyncio.sleep(self.slow[prompt] if not history and prompt in self.slow else self.step_s * random.random())
    logits = np.stack([toy_logits(history + ids[:i + 1]) for i in range(len(ids))])[None]
    if prompt in self.poison and history:
      logits[..., 3] = np.nan  # its decode steps go bad
    if prompt in self.broken and history:
      raise RuntimeError("this request's forward pass broke")
    history += ids
    return logits, inference_state

  async def finish_request(self, request_id):
    self.history.pop(request_id, None)


def encode(prompt: str) -> np.ndarray:
  return np.array([1 + ord(c) % (VOCAB - 1) for c in prompt], dtype=np.int64)


def toy_logits(tokens: List[int]) -> np.ndarray:
  rng = np.random.default_rng(zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes()))
  logits = rng.normal(size=VOCAB).astype(np.float32) * 2
  logits[EOS] -= 1.5  # answers of a few tokens, not one
  return logits


def reference_greedy(prompt: str, max_tokens: int) -> List[int]:
  """What greedy decoding must give, computed without any node, engine or batching."""
  tokens, out = list(encode(prompt)), []
  while len(out) < max_tokens:
    token = int(np.argmax(toy_logits(tokens)))
    out.append(token)
    tokens.append(token)
    if token == EOS:
      break
  return out


def make_node(engine, config: Optional[BatchingConfig] = None, max_generate_tokens: int = 1024):
  node = Node("toy-node", None, engine, NoDiscovery(), NoopShardDownloader(), partitioning_strategy=RingMemoryWeightedPartitioningStrategy(),
              max_generate_tokens=max_generate_tokens)
  plugin = register_batching(node, config) if config else None
  return node, plugin


async def ask(node, prompt: str, params: SamplingParams = SamplingParams(), delay: float = 0.0, timeout: float = 60) -> List[int]:
  await asyncio.sleep(delay)
  out: List[int] = []
  async for tokens, _ in generate(node, TOY, prompt, params, timeout=timeout):
    out += tokens
  return out


def leftover_tasks():
  return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]


async def settle(node):
  await node.stop()
  for _ in range(50):  # the node's own last cleanups (freeing caches) run just after stop returns
    if not leftover_tasks():
      break
    await asyncio.sleep(0.01)
  assert not leftover_tasks()
  assert not node.outstanding_requests


def workload(n: int, seed: int):
  rng = random.Random(seed)
  return [(f"prompt {i} " + "x" * rng.randrange(0, 12), rng.randrange(1, 12), rng.uniform(0, 0.05)) for i in range(n)]


async def run_workload(engine, config, jobs):
  node, plugin = make_node(engine, config)
  await node.start()
  outputs = await asyncio.wait_for(asyncio.gather(*[ask(node, p, SamplingParams(max_tokens=m), d) for p, m, d in jobs]), 120)
  await settle(node)
  return outputs, plugin


@pytest.mark.parametrize("n", [1, 2, 7, 33, 200])
async def test_concurrent_requests_all_finish_and_match_unbatched(n):
  jobs = workload(n, seed=n)
  expected = [reference_greedy(p, m) for p, m, _ in jobs]
  unbatched, _ = await run_workload(ToyEngine(), None, jobs)
  batched, plugin = await run_workload(ToyEngine(), BatchingConfig(batch_size=8, timeout_ms=5), jobs)
  assert unbatched == expected
  assert batched == expected
  if n >= 33:
    assert plugin.sampler.stats.mean > 1.5, plugin.sampler.stats  # requests really were sampled together
    assert plugin.step_stats().mean > 1.5, plugin.step_stats()  # and ran their forward passes together
    assert max(plugin.sampler.stats.sizes) <= 8 and max(plugin.step_stats().sizes) <= 8


async def test_lone_request_pays_no_timeout():
  node, plugin = make_node(ToyEngine(step_s=0, sample_s=0), BatchingConfig(batch_size=8, timeout_ms=10_000))
  start = time.monotonic()
  assert await asyncio.wait_for(ask(node, "alone", SamplingParams(max_tokens=5)), 30) == reference_greedy("alone", 5)
  assert time.monotonic() - start < 2
  await settle(node)


async def test_mixed_parameters_in_one_batch_each_get_their_own():
  mixed = [
    ("greedy", SamplingParams(max_tokens=10)),
    ("hot seeded", SamplingParams(temperature=1.3, seed=7, max_tokens=10)),
    ("top-k one", SamplingParams(temperature=5.0, top_k=1, seed=3, max_tokens=10)),  # = greedy however hot
    ("top-p tiny", SamplingParams(temperature=2.0, top_p=1e-6, seed=4, max_tokens=10)),  # = greedy too
    ("min-p one", SamplingParams(temperature=2.0, min_p=1.0, seed=5, max_tokens=10)),  # only the best survives
    ("warm seeded", SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=11, max_tokens=10)),
    ("short", SamplingParams(max_tokens=2)),
  ]

  async def together(config, crowd=0):
    node, plugin = make_node(ToyEngine(), config)
    extra = [ask(node, f"crowd {i}", SamplingParams(temperature=0.9, seed=i, max_tokens=6)) for i in range(crowd)]
    outputs = await asyncio.wait_for(asyncio.gather(*[ask(node, p, params) for p, params in mixed], *extra), 60)
    await settle(node)
    return outputs[:len(mixed)], plugin

  config = BatchingConfig(batch_size=16, timeout_ms=50)
  first, plugin = await together(config)
  assert max(plugin.sampler.stats.sizes) > 1  # they did share sampling calls
  again, _ = await together(config, crowd=9)  # other company, other batch composition
  alone = [await ask_alone(p, params, config) for p, params in mixed]
  unbatched = [await ask_alone(p, params, None) for p, params in mixed]
  assert first == again == alone == unbatched
  for (prompt, params), out in zip(mixed, first):
    if params.temperature == 0 or prompt in ("top-k one", "top-p tiny", "min-p one"):
      assert out == reference_greedy(prompt, params.max_tokens), prompt
  assert first[1] != reference_greedy("hot seeded", 10)  # hot sampling does sample
  assert len(first[-1]) == 2


async def ask_alone(prompt, params, config):
  node, _ = make_node(ToyEngine(), config)
  out = await asyncio.wait_for(ask(node, prompt, params), 30)
  await settle(node)
  return out


# The toy engine knows a request by its first input, so these tests keep prompts whole (no prefill chunks).
WHOLE_PROMPTS = BatchingConfig(batch_size=8, timeout_ms=50, prefill_chunk=0)


async def test_a_failing_row_ends_only_its_request():
  node, plugin = make_node(ToyEngine(poison=["poison"]), WHOLE_PROMPTS)
  prompts = [f"fine {i}" for i in range(6)] + ["poison"]
  results = await asyncio.wait_for(asyncio.gather(*[ask(node, p, SamplingParams(max_tokens=8)) for p in prompts], return_exceptions=True), 60)
  for prompt, result in zip(prompts[:-1], results[:-1]):
    assert result == reference_greedy(prompt, 8)
  assert isinstance(results[-1], GenerationError) and "NaN" in str(results[-1])
  assert max(plugin.sampler.stats.sizes) > 1
  await settle(node)


async def test_a_failing_forward_pass_ends_only_its_request():
  node, plugin = make_node(ToyEngine(broken=["broken"]), WHOLE_PROMPTS)
  prompts = [f"fine {i}" for i in range(5)] + ["broken"]
  results = await asyncio.wait_for(asyncio.gather(*[ask(node, p, SamplingParams(max_tokens=8)) for p in prompts], return_exceptions=True), 60)
  assert results[:-1] == [reference_greedy(p, 8) for p in prompts[:-1]]
  assert isinstance(results[-1], GenerationError) and "broke" in str(results[-1])
  assert max(plugin.step_stats().sizes) > 1
  await settle(node)


async def test_stop_with_a_pending_flush_leaves_nothing_behind():
  # "slow" holds the engine step it is in; requests arriving meanwhile wait for the next step when stop() comes.
  engine = ToyEngine(slow={"slow": 0.5})
  node, plugin = make_node(engine, BatchingConfig(batch_size=8, timeout_ms=60_000))
  await node.start()
  asks = [asyncio.ensure_future(ask(node, p, SamplingParams(max_tokens=50), delay)) for p, delay in
          [("slow", 0), ("a", 0), ("b", 0), ("c", 0.1), ("d", 0.1)]]
  await asyncio.sleep(0.2)
  assert plugin_waiting(plugin)
  start = time.monotonic()
  await asyncio.wait_for(node.stop(), 10)
  results = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), 10)
  assert all(isinstance(r, Exception) for r in results), results
  assert time.monotonic() - start < 5
  for _ in range(100):
    if not leftover_tasks():
      break
    await asyncio.sleep(0.01)
  assert not leftover_tasks()
  assert not node.outstanding_requests
  assert not any(plugin.sampler._pending.values()) and not plugin.sampler._timers and not plugin.sampler._flushing
  assert all(not s.ready and (s._loop_task is None or s._loop_task.done()) for s in plugin.schedulers.values())


def plugin_waiting(plugin) -> bool:
  """Anything of the plugin's waiting for company: a sampling batch or the next engine step."""
  return any(plugin.sampler._pending.values()) or any(s.ready for s in plugin.schedulers.values())


async def test_without_settings_no_plugin_is_registered_and_the_core_path_runs():
  assert batching_config_from(Namespace(batch_size=None, batch_timeout_ms=None, prefill_chunk=None), {}) is None
  node, _ = make_node(ToyEngine())
  assert node.plugins.get_plugin(PLUGIN_NAME) is None
  core = node.plugins.get_plugin("exo-core")
  assert [impl.plugin for impl in node.plugins.hook.exo_process_inference_result.get_hookimpls()] == [core]
  calls = []
  unbatched = node.process_inference_result_unbatched

  async def spy(*args):
    calls.append(args[2])
    return await unbatched(*args)
  node.process_inference_result_unbatched = spy
  assert await ask(node, "plain", SamplingParams(max_tokens=4)) == reference_greedy("plain", 4)
  assert len(calls) == len(reference_greedy("plain", 4))
  await settle(node)


async def test_plugin_from_the_exo_entry_point_group_is_loaded(tmp_path, monkeypatch):
  (tmp_path / "exo_toy_plugin.py").write_text(textwrap.dedent("""
    from exo.orchestration.batching.hookspecs import hookimpl

    @hookimpl
    def exo_run_summary(node):
      return "toy plugin was here"
  """))
  dist = tmp_path / "exo_toy_plugin-0.1.dist-info"
  dist.mkdir()
  (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: exo-toy-plugin\nVersion: 0.1\n")
  (dist / "entry_points.txt").write_text("[exo]\ntoy = exo_toy_plugin\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  node, _ = make_node(ToyEngine())
  assert "toy plugin was here" in node.plugins.hook.exo_run_summary(node=node)
  assert node.plugins.get_plugin("toy") is not None


def test_a_rows_sample_does_not_depend_on_the_other_rows_filters():
  from exo.inference.sampling import make_generator, sample_rows
  logits = np.random.default_rng(0).normal(size=(3, VOCAB)).astype(np.float32) * 2
  mine = SamplingParams(temperature=1.5, top_k=12, top_p=0.8, min_p=0.02, seed=1)

  def draws(neighbours):
    gens = [make_generator(1)] + [make_generator(i) for i in range(len(neighbours))]
    return [int(sample_rows(logits[:1 + len(neighbours)], [mine] + neighbours, gens)[0]) for _ in range(200)]
  alone = draws([])
  assert draws([SamplingParams(temperature=1.0)]) == alone  # a neighbour with no top-k
  assert draws([SamplingParams(temperature=1.0, top_k=40), SamplingParams()]) == alone  # a neighbour wanting more

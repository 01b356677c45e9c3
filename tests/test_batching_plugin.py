"""The batching plugin on a real Node (a ring of one) with a toy engine whose steps and sampling really suspend,
which is what made upstream's batcher hang: many requests at random times all finish, outputs match unbatched,
each request gets its own sampling parameters, a bad row fails alone, stop() leaves nothing behind."""
import asyncio
import random
import textwrap
import time
from argparse import Namespace

import numpy as np
import pytest

from exo.inference.sampling import SamplingParams
from exo.main import load_installed_plugins
from exo.orchestration.batching.config import BatchingConfig, batching_config_from
from exo.orchestration.batching.plugin import PLUGIN_NAME
from exo.orchestration.generation import GenerationError
from tests.support.toy import VOCAB, ToyEngine, ask, leftover_tasks, make_node, reference_greedy, settle
from tests.support.waiting import eventually

pytestmark = pytest.mark.unit


def workload(n: int, seed: int):
  rng = random.Random(seed)
  return [(f"prompt {i} " + "x" * rng.randrange(0, 12), rng.randrange(1, 12), rng.uniform(0, 0.05)) for i in range(n)]


async def run_workload(engine, config, jobs):
  node, plugin = make_node(engine, config)
  await node.start()
  outputs = await asyncio.wait_for(asyncio.gather(*[ask(node, p, SamplingParams(max_tokens=m), d) for p, m, d in jobs]), 120)
  await settle(node)
  return outputs, plugin


@pytest.mark.parametrize("n", [1, 2, 7, 33, 100])
async def test_concurrent_requests_all_finish_and_match_unbatched(n):
  jobs = workload(n, seed=n)
  expected = [reference_greedy(p, m) for p, m, _ in jobs]
  unbatched, _ = await run_workload(ToyEngine(), None, jobs)
  batched, plugin = await run_workload(ToyEngine(), BatchingConfig(batch_size=8, timeout_ms=5), jobs)
  assert unbatched == expected
  assert batched == expected
  if n >= 33:
    assert plugin.node.step_core.sampling_stats.mean > 1.5, plugin.node.step_core.sampling_stats  # requests really were sampled together
    assert plugin.step_stats().mean > 1.5, plugin.step_stats()  # and ran their forward passes together
    assert max(plugin.node.step_core.sampling_stats.sizes) <= 8 and max(plugin.step_stats().sizes) <= 8


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
  assert max(plugin.node.step_core.sampling_stats.sizes) > 1  # they did share sampling calls
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
  assert max(plugin.node.step_core.sampling_stats.sizes) > 1
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
  await eventually(lambda: len(node.outstanding_requests) == 5 and plugin_waiting(plugin), 10)  # all five in, some waiting
  start = time.monotonic()
  await asyncio.wait_for(node.stop(), 10)
  results = await asyncio.wait_for(asyncio.gather(*asks, return_exceptions=True), 10)
  assert all(isinstance(r, Exception) for r in results), results
  assert time.monotonic() - start < 5
  await eventually(lambda: not leftover_tasks(), 1)  # the node's last cleanups run just after stop returns
  assert not node.outstanding_requests
  assert all(not s.ready for s in plugin.node.steps.schedulers.values()) and not plugin.node.steps.running


def plugin_waiting(plugin) -> bool:
  """Anything of the plugin's waiting for company: the next engine step."""
  return any(s.ready for s in plugin.node.steps.schedulers.values())


async def test_without_settings_no_plugin_is_registered_and_the_core_path_runs():
  assert batching_config_from(Namespace(batch_size=None, batch_timeout_ms=None, prefill_chunk=None), {}) is None
  node, _ = make_node(ToyEngine())
  assert node.plugins.get_plugin(PLUGIN_NAME) is None
  core = node.plugins.get_plugin("exo-core")
  assert [impl.plugin for impl in node.plugins.hook.exo_process_inference_result.get_hookimpls()] == [core]
  calls = []
  unbatched = node.step_core.add

  async def spy(*args):
    calls.append(args[2])
    return await unbatched(*args)
  node.step_core.add = spy
  assert await ask(node, "plain", SamplingParams(max_tokens=4)) == reference_greedy("plain", 4)
  assert len(calls) == len(reference_greedy("plain", 4))
  await settle(node)


async def test_installed_plugins_load_in_the_command_not_in_a_node_built_in_code(tmp_path, monkeypatch):
  (tmp_path / "exo_toy_plugin.py").write_text(textwrap.dedent("""
    from exo.orchestration.hookspecs import hookimpl

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
  assert node.plugins.get_plugin("toy") is None and node.plugins.hook.exo_run_summary(node=node) == []
  assert load_installed_plugins(node) == ["toy"]
  assert node.plugins.hook.exo_run_summary(node=node) == ["toy plugin was here"]


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

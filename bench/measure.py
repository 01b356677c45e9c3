"""In-process throughput check of the batching plugin on the real SmolLM2 (a ring of one, no HTTP):
N concurrent requests with different prompts, batching off then on (alternating), aggregate decode tokens/s,
the ratio on ÷ off measured in the same run, and whether greedy outputs were identical.

  python bench/measure.py --n 1 8 16 --tokens 64 --repeats 1

The HTTP benchmark (bench/bench.py) is the reference; this is the quick loop for engine and scheduler work."""
import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exo.download.shard_download import HFShardDownloader  # noqa: E402
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine  # noqa: E402
from exo.inference.sampling import SamplingParams  # noqa: E402
from exo.models import build_base_shard  # noqa: E402
from exo.networking.discovery import NoDiscovery  # noqa: E402
from exo.orchestration.batching.config import DEFAULT_PREFILL_CHUNK, DEFAULT_TIMEOUT_MS, BatchingConfig  # noqa: E402
from exo.orchestration.batching.plugin import register_batching  # noqa: E402
from exo.orchestration.generation import generate  # noqa: E402
from exo.orchestration.node import Node  # noqa: E402
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy  # noqa: E402

WORDS = "river stone lantern orchard copper meadow harbor violet thunder canyon pepper glacier saddle marble falcon cedar".split()


def prompt_for(i: int, words: int) -> str:
  """A different prompt per request, about `words` + 10 tokens long."""
  body = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(words))
  return f"Request {i}. Continue this list with more words: {body}"


async def run_once(engine, n: int, tokens: int, words: int, config: Optional[BatchingConfig]):
  node = Node("measure", None, engine, NoDiscovery(), HFShardDownloader(), partitioning_strategy=RingMemoryWeightedPartitioningStrategy(), max_generate_tokens=tokens)
  plugin = register_batching(node, config) if config else None
  base = build_base_shard("smollm2-135m", engine.__class__.__name__)
  params = SamplingParams(max_tokens=tokens, ignore_eos=True)
  lasts: List[float] = []

  async def one(i: int) -> List[int]:
    out: List[int] = []
    async for delta, _ in generate(node, base, prompt_for(i, words), params, timeout=600):
      out += delta
    lasts.append(time.perf_counter())
    return out

  start = time.perf_counter()
  outputs = await asyncio.gather(*[one(i) for i in range(n)])
  await node.stop()
  # docs/benchmark.md's aggregate decode tokens/s: all completion tokens / (last token time - first send time)
  return {"outputs": outputs, "tokens_per_s": sum(len(o) for o in outputs) / (max(lasts) - start),
          "steps": plugin.step_stats().mean if plugin else 1.0}


async def main(args) -> None:
  engine = NumpyDynamicShardInferenceEngine(HFShardDownloader())
  await run_once(engine, 2, 4, args.words, None)  # warm up: load weights, touch every code path
  await run_once(engine, 2, 4, args.words, BatchingConfig(max(args.n), args.timeout_ms, args.prefill_chunk))
  for n in args.n:
    config = BatchingConfig(max(2, n), args.timeout_ms, args.prefill_chunk)
    off, on, same = [], [], True
    for _ in range(args.repeats):
      a = await run_once(engine, n, args.tokens, args.words, None)
      b = await run_once(engine, n, args.tokens, args.words, config)
      off.append(a["tokens_per_s"])
      on.append(b["tokens_per_s"])
      same &= a["outputs"] == b["outputs"]
    print(f"N={n:3d}  off {statistics.median(off):7.1f} tok/s  on {statistics.median(on):7.1f} tok/s  ratio {statistics.median(on) / statistics.median(off):5.2f}x"
          f"  mean step {b['steps']:.1f}  greedy identical: {same}", flush=True)


if __name__ == "__main__":
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--n", type=int, nargs="+", default=[1, 8, 16])
  p.add_argument("--tokens", type=int, default=64, help="tokens generated per request (EOS ignored)")
  p.add_argument("--words", type=int, default=50, help="prompt length in words (about a token each)")
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument("--timeout-ms", type=float, default=DEFAULT_TIMEOUT_MS)
  p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK)
  asyncio.run(main(p.parse_args()))

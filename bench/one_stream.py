"""One node, one stream (or a few at once), through the real HTTP API with batching on: the time between tokens
against the bare engine step at the same rows on the same cores, the figure of "time between tokens spent outside
the engine" (target: 1/ITL at least 95% of 1/step for one stream).

  python bench/one_stream.py                       # the node on every core, 1 stream, 3 repeats of 128 tokens
  python bench/one_stream.py --cores 1 --streams 8
  python bench/one_stream.py --ab EXO_RUN_AHEAD=0   # A/B: a second node with this setting, the repeats alternating between the two
  python bench/one_stream.py --temperature 0.7 --top-p 0.9   # sampled rows (the bare step does not sample: sampling's cost shows)

Each repeat is a burst of --streams streams; ITL p50 is the median over the repeats. The bare step is
bench/machines.py's step_times (the whole model, the same rows, a context of the prompt and half the reply), timed in
a child pinned to the same cores right after the node has stopped. On a shared machine both drift with the others'
load: compare figures of one run."""
import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import ROOT, burst, make_prompts, summarise  # noqa: E402
from machines import Machines  # noqa: E402


class OneNode(Machines):
  def cores(self, i: int) -> set:
    return self.args.core_set


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--engine", default="numpy")
  p.add_argument("--cores", default=None, help="the cores the node and the step timer are pinned to, e.g. 1 or 0,1 (default: all of this process's)")
  p.add_argument("--streams", type=int, default=1)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--tokens", type=int, default=128)
  p.add_argument("--prompt-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="each request's temperature (seeded; 0: greedy)")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--ab", default=None, metavar="NAME=VALUE", help="also a node with this environment variable set; the repeats alternate between the two")
  args = p.parse_args()
  args.core_set = {int(c) for c in args.cores.split(",")} if args.cores else os.sched_getaffinity(0)
  args.cores_per_node, args.hop_delay_ms, args.batch_size, args.batch_timeout_ms, args.prefill_chunk = len(args.core_set), 0, max(2, args.streams), 5.0, None
  ways = {"as set": {}}
  if args.ab:
    name, _, value = args.ab.partition("=")
    ways[args.ab] = {name: value}
  itls = {way: [] for way in ways}
  async with contextlib.AsyncExitStack() as stack:
    nodes = {}
    for way, environ in ways.items():
      with _environ(environ):  # (the node's process takes this process's environment when it starts)
        nodes[way] = await stack.enter_async_context(OneNode(1, args, Path(tempfile.mkdtemp(prefix="exo-one-stream-"))))
      await burst(nodes[way].url, make_prompts(2, 48, salt=99), 8)  # warm-up: the model's first steps, allocations
    for repeat in range(args.repeats):
      for way, node in nodes.items():
        sampling = [{"temperature": args.temperature, "top_p": args.top_p, "seed": i} for i in range(args.streams)]
        result = summarise(await burst(node.url, make_prompts(args.streams, args.prompt_tokens, salt=repeat), args.tokens, sampling))
        itls[way].append(result["itl_p50"])
        print(f"  repeat {repeat} ({way}): ITL p50 {1e3 * result['itl_p50']:.2f} ms, {result['tok_s']:.1f} tok/s", flush=True)
  timer = subprocess.run([sys.executable, str(ROOT / "bench" / "machines.py"), "--step-times", str(args.streams), "--engine", args.engine,
                          "--context", str(args.prompt_tokens + args.tokens // 2)], cwd=ROOT, capture_output=True, text=True, check=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, args.core_set))
  step = json.loads(timer.stdout.strip().splitlines()[-1])[str(args.streams)]
  for way in ways:
    itl = statistics.median(itls[way])
    print(f"{args.streams} stream(s) on core(s) {','.join(map(str, sorted(args.core_set)))}{'' if len(ways) == 1 else f' ({way})'}: ITL p50 {1e3 * itl:.2f} ms, "
          f"bare {args.streams}-row step {1e3 * step:.2f} ms, step / ITL {step / itl:.3f} (outside the engine {1e3 * (itl - step):.2f} ms a token)")


@contextlib.contextmanager
def _environ(values: dict):
  saved = {name: os.environ.get(name) for name in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value


if __name__ == "__main__":
  asyncio.run(main())

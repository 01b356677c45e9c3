"""Two chat models on one real `exo` process (numpy engine): the embedded SmolLM2-135M and a random-weight Llama in
llama-3.2-1b's place (written into the node's EXO_HOME as tests/support/checkpoints.py writes it), asked in turn,
one request after the other, with the node holding one model at a time (EXO_MAX_LOADED_MODELS=1, every switch a
reload) and with its default (both stay loaded). Prints the seconds per request and the loads /v1/state counts.

  python bench/several_models.py
  python bench/several_models.py --rounds 6 --tokens 32
"""
import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import Cluster  # noqa: E402

MODELS = ("smollm2-135m", "llama-3.2-1b")


async def ask(session: aiohttp.ClientSession, url: str, model: str, tokens: int) -> float:
  started = time.perf_counter()
  body = {"model": model, "messages": [{"role": "user", "content": "Tell me about rivers."}], "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
  async with session.post(f"{url}/v1/chat/completions", json=body) as response:
    if response.status != 200:
      raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
    await response.read()
  return time.perf_counter() - started


async def run(max_models: int, args, log_dir: Path) -> dict:
  home = log_dir / "home0"
  os.environ["EXO_HOME"] = str(home)
  from tests.support.checkpoints import install_random_model
  install_random_model(MODELS[1])
  os.environ["EXO_MAX_LOADED_MODELS"] = str(max_models)
  async with Cluster(1, "numpy", False, args, log_dir) as cluster:
    url = f"http://127.0.0.1:{cluster.api_ports[0]}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
      seconds = [await ask(session, url, MODELS[i % 2], args.tokens) for i in range(2 * args.rounds)]
      async with session.get(f"{url}/v1/state") as response:
        state = await response.json()
  return {"seconds": seconds, "loads": state["model_loads"]}


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rounds", type=int, default=4, help="requests for each model, alternating")
  p.add_argument("--tokens", type=int, default=16, help="generated tokens per request")
  args = p.parse_args()
  results = {}
  for max_models in (1, 2):
    with tempfile.TemporaryDirectory() as tmp:
      results[max_models] = result = await run(max_models, args, Path(tmp))
    later = result["seconds"][2:]  # after each model's first request (its first load)
    print(f"EXO_MAX_LOADED_MODELS={max_models}: {result['loads']} loads for {len(result['seconds'])} requests; "
          f"median {statistics.median(later):.2f} s a request after the first two", flush=True)
  ratio = statistics.median(results[1]["seconds"][2:]) / statistics.median(results[2]["seconds"][2:])
  print(f"one at a time / both loaded, median seconds a request: {ratio:.1f}x")


if __name__ == "__main__":
  asyncio.run(main())

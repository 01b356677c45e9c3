"""Seconds from a fresh interpreter to the first prompt's logits on the numpy engine: importing it, building or
reading its compiled kernels (exo/inference/numpy/native.py), loading the embedded SmolLM2 kept quantized, and one
short prompt.

  python bench/first_load.py            # the kernels as $EXO_HOME caches them
  python bench/first_load.py --cold     # an empty kernel cache (a temporary EXO_HOME), as on a fresh install"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_PROMPT = """
import asyncio
from exo.download.shard_download import HFShardDownloader
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from tests.support.models import smollm2_shard

async def main():
  engine = NumpyDynamicShardInferenceEngine(HFShardDownloader())
  await engine.ensure_shard(smollm2_shard())
  await engine.infer_prompt("first", smollm2_shard(), "Hello")

asyncio.run(main())
"""


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--cold", action="store_true", help="start from an empty kernel cache")
  args = p.parse_args()
  with tempfile.TemporaryDirectory(prefix="exo-first-load-") as home:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if args.cold:
      env["EXO_HOME"] = home
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", FIRST_PROMPT], check=True, env=env, cwd=ROOT)
    print(f"{'cold' if args.cold else 'cached'}: {time.perf_counter() - started:.1f} s to the first prompt's logits")


if __name__ == "__main__":
  main()

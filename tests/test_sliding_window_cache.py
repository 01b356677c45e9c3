"""A sliding-window layer's KV cache keeps its window only (exo/inference/numpy/cache.py): the numpy engine hands
back the pages of positions a sliding layer's queries no longer see, counts what it really holds, and still answers
transformers' greedy tokens far past the window; a prefix reuse longer than the window answers as a fresh run.

References: tests/fixtures/models/long_decodes.json (tests/fixtures/make_long_decodes.py), transformers' greedy
continuation of the window-4 fixtures for 200 tokens. The fixtures' rows hold 32 (head dim 32) or 64 (head dim 16)
float32 positions a page, so a 200-token decode hands pages back many times over."""
import ctypes
import json
import mmap
import shutil
from pathlib import Path

import numpy as np
import pytest

from exo.inference.numpy.cache import KVCache, KVPool
from exo.inference.shard import Shard
from exo.inference.weights import load_shard_weights

pytestmark = pytest.mark.model

FIXTURES = Path(__file__).parent / "fixtures" / "models"
LONG = json.loads((FIXTURES / "long_decodes.json").read_text())
FIXTURE_OF = {"gemma2": "gemma2", "gemma3_text": "gemma3_text", "gpt_oss": "gpt_oss", "mistral_window": "mistral"}


def checkpoint(name: str, tmp_path: Path) -> Path:
  """The fixture `name` stands for; mistral_window: the mistral fixture with `sliding_window: 4` in its config."""
  path = FIXTURES / FIXTURE_OF[name]
  if name == "mistral_window":
    path = Path(shutil.copytree(path, tmp_path / name))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 4}))
  return path


def model(engine: str, path: Path, kv_dtype=None):
  config_json = json.loads((path / "config.json").read_text())
  n_layers = (config_json.get("text_config") or config_json)["num_hidden_layers"]
  shard = Shard(str(path), 0, n_layers - 1, n_layers)
  config, weights = load_shard_weights(path, shard, keep_quantized=engine == "mlx")
  if engine == "mlx":
    from exo.inference.mlx.llama import Llama
    return Llama(config, shard, weights)
  from exo.inference.numpy.llama import Llama
  return Llama(config, shard, weights, kv_dtype=kv_dtype)


def resident_bytes(array: np.ndarray) -> int:
  """Bytes of the array's pages the kernel really holds (mincore), whatever a cache says it holds."""
  libc = ctypes.CDLL(None, use_errno=True)
  address = array.__array_interface__["data"][0]
  start = address // mmap.PAGESIZE * mmap.PAGESIZE
  length = address + array.nbytes - start
  pages = -(-length // mmap.PAGESIZE)
  vector = (ctypes.c_ubyte * pages)()
  assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0, ctypes.get_errno()
  return sum(v & 1 for v in vector) * mmap.PAGESIZE


def forced_decode(llama, tokens: list, chunk: int = 0, caches=None):
  """The prompt (in chunks of `chunk`, 0: whole), then every reference token fed in turn as the model's next input:
  the model's greedy choice at each step."""
  prompt, answer = LONG["prompt"], tokens
  cache = caches or llama.new_cache()
  pieces = [prompt[i:i + chunk] for i in range(0, len(prompt), chunk)] if chunk else [prompt]
  for piece in pieces:
    logits = llama.forward([np.array(piece)], [cache])[0]
  chosen = [int(np.argmax(logits))]
  for token in answer[:-1]:
    chosen.append(int(np.argmax(llama.forward([np.array([token])], [cache])[0])))
  return chosen, cache


def assert_equal_but_close_steps(name: str, chosen: list) -> None:
  expected = LONG[name]["tokens"]
  differ = [step for step, (a, b) in enumerate(zip(chosen, expected)) if a != b and step not in LONG[name]["close"]]
  assert not differ, f"{name}: greedy steps {differ} differ from transformers' (of {len(expected)})"


@pytest.mark.parametrize("name", list(FIXTURE_OF))
@pytest.mark.parametrize("engine, kv_dtype, chunk", [("numpy", np.float32, 0), ("numpy", np.float16, 3), ("mlx", None, 0), ("mlx", None, 3)])
def test_greedy_tokens_far_past_the_window_equal_transformers(engine, kv_dtype, chunk, name, tmp_path):
  """200 steps, the window 4: the numpy cache has handed back most of its sliding rows' pages by the end (float16
  rows, 64 or 128 positions a page, with the prompt in chunks of 3), the MLX cache cut its sliding layers' arrays
  down to their window twice or more."""
  if engine == "mlx":
    pytest.importorskip("mlx.core")
  llama = model(engine, checkpoint(name, tmp_path), kv_dtype)
  chosen, cache = forced_decode(llama, LONG[name]["tokens"], chunk)
  assert_equal_but_close_steps(name, chosen)
  assert not cache.holds_prefix(len(LONG["prompt"])), "the sliding layers let go of nothing"


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss"])
def test_an_mlx_sliding_layer_keeps_a_window_or_two(name, tmp_path):
  pytest.importorskip("mlx.core")
  from exo.inference.mlx.cache import MIN_CAPACITY
  llama = model("mlx", checkpoint(name, tmp_path))
  _, cache = forced_decode(llama, LONG[name]["tokens"])
  length, window = cache.length, llama.config.sliding_window
  for layer, keys in enumerate(cache.keys):
    if layer in cache.sliding:
      assert keys.shape[1] <= window + 2 * MIN_CAPACITY < length
      assert cache.start <= length + 1 - window  # what the next query sees is held
    else:
      assert keys.shape[1] >= length


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text", "gpt_oss", "mistral_window"])
def test_a_sliding_layer_holds_its_window_and_the_cache_counts_what_the_kernel_holds(name, tmp_path):
  llama = model("numpy", checkpoint(name, tmp_path), np.float32)
  config, pool = llama.config, llama.pool
  assert len(pool.sliding) == len(config.sliding_layers) > 0
  _, cache = forced_decode(llama, LONG[name]["tokens"])
  length = len(LONG["prompt"]) + len(LONG[name]["tokens"]) - 1
  assert cache.length == length
  layers, planes, heads, _, head_dim = pool.slot_shape
  row = -(-length * pool.position_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # a full layer's row: every position
  # the window, across a page boundary, and what may wait to go back with the next step's
  window_pages = -(-(config.sliding_window + 1) * pool.position_bytes // mmap.PAGESIZE) + pool.forget_step // mmap.PAGESIZE
  for layer in range(layers):
    held = resident_bytes(cache.data[layer])
    rows = planes * heads
    if layer in pool.sliding:
      assert held <= rows * window_pages * mmap.PAGESIZE < rows * row, f"sliding layer {layer} holds {held} bytes"
    else:
      assert held == rows * row
  assert cache.nbytes == resident_bytes(cache.data)


def test_a_pool_without_sliding_layers_hands_nothing_back():
  pool = KVPool(n_layers=2, n_kv_heads=1, head_dim=32, positions=1024, dtype=np.float32)
  cache = KVCache(pool)
  cache.data[:, :, :, :300] = 1.0
  cache.advance(300)
  assert cache.forgotten == 0 and cache.nbytes == resident_bytes(cache.data) == 2 * 2 * -(-300 * 128 // mmap.PAGESIZE) * mmap.PAGESIZE


def test_a_sliding_row_goes_back_a_quarter_window_at_a_time():
  """Window 256, 128 bytes a position: a quarter window is 8 KiB, two pages; layer 1 slides, layer 0 does not."""
  pool = KVPool(n_layers=2, n_kv_heads=1, head_dim=32, positions=2048, dtype=np.float32, window=256, sliding=[1])
  assert pool.forget_step == 2 * mmap.PAGESIZE
  cache = KVCache(pool)
  seen = []
  for length in range(1, 1025):
    cache.data[:, :, :, length - 1] = 1.0
    cache.advance(1)
    seen.append(cache.forgotten)
  assert sorted(set(seen)) == list(range(0, (1024 - 255) * 128 // mmap.PAGESIZE * mmap.PAGESIZE + 1, 2 * mmap.PAGESIZE))
  assert cache.holds_prefix(1024) and not cache.holds_prefix(1024 - 256)
  assert resident_bytes(cache.data[1]) == 2 * (1024 * 128 - cache.forgotten) and cache.nbytes == resident_bytes(cache.data)


class LocalFiles:
  """A downloader for checkpoints already on disk: the shard's model id is its path."""

  async def ensure_shard(self, shard, engine_classname):
    return Path(shard.model_id)


@pytest.mark.parametrize("engine_name", ["numpy", "mlx"])
async def test_a_prefix_longer_than_the_window_is_reused_only_while_its_window_is_held_and_answers_as_a_fresh_run(engine_name, tmp_path):
  """A chat's next turn (its prefix ends where the last answer did) reuses the whole prefix, 3 blocks past the
  window, and answers as the same prompt computed whole. A prompt whose window the first request has since decoded
  past is not reused from that cache (its sliding rows read as zeros there) and is computed again, still right."""
  from exo.inference.engines import get_inference_engine
  from exo.inference.prefix_cache import BLOCK, block_keys
  from tests.support.checkpoints import fixture_checkpoint
  path = fixture_checkpoint("gemma2", tmp_path / "gemma2")
  shard = Shard(str(path), 0, 1, 2)
  if engine_name == "mlx":
    pytest.importorskip("mlx.core")
  engine = get_inference_engine(engine_name, LocalFiles())
  await engine.ensure_shard(shard)
  prompt = np.array(LONG["prompt"] + LONG["gemma2"]["tokens"][:39])  # 48 positions: 6 blocks
  answer = LONG["gemma2"]["tokens"][39:159]  # 120 more: the prompt's last window goes back to the kernel

  async def step(request_id, ids):
    return (await engine.infer_tensor(request_id, shard, np.array(ids)[None]))[0]

  await step("first", prompt)
  engine.remember_prefix("first", block_keys(shard.model_id, prompt))
  for token in answer:
    await step("first", [token])
  conversation = np.concatenate([prompt, answer])
  cache = engine.caches["first"]
  assert not cache.holds_prefix(len(prompt)), "the prompt's window should have gone by now"
  assert engine.request_kv_bytes("first") == cache.nbytes  # what /v1/state reports: what the cache holds
  if engine_name == "numpy":
    assert cache.nbytes == resident_bytes(cache.data)
  engine.extend_prefix("first", block_keys(shard.model_id, conversation))
  await engine.finish_request("first")

  next_turn = np.concatenate([conversation, [5, 6, 7, 8, 9]])
  reused = await engine.start_from_prefix("next", shard, block_keys(shard.model_id, next_turn), len(next_turn) - 1)
  assert reused == len(conversation) // BLOCK * BLOCK > 4
  cached = await step("next", next_turn[reused:])
  whole = await step("whole", next_turn)
  np.testing.assert_allclose(cached, whole, atol=1e-4)
  await engine.finish_request("whole")

  same_prompt = np.concatenate([prompt, [300, 301, 302]])
  reused = await engine.start_from_prefix("again", shard, block_keys(shard.model_id, same_prompt), len(same_prompt) - 1)
  assert reused == 0, "the first request's cache no longer holds the window the prompt's next query sees"
  again = await step("again", same_prompt)
  fresh = await step("fresh", same_prompt)
  np.testing.assert_allclose(again, fresh, atol=1e-4)

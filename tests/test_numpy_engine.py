"""The numpy engine on the real SmolLM2-135M: answers, KV-cache correctness, sharding, isolation, memory, and attention
shared among the cores. (Its parts without the model: test_numpy_kernels.py.)"""
import asyncio
import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from exo.inference.numpy.llama import Llama
from exo.inference.weights import load_shard_weights
from tests.support.engines import FLOAT16_KV_LOGIT_ATOL
from tests.support.models import smollm2_shard

# Logits of the same forward computed two ways (cached vs recomputed, one shard vs two) agree to this absolute
# tolerance; float32 summation order differs between the ways, and the engine's float16 KV cache rounds what
# differed in a last bit a unit apart now and then (tests/support/engines.py); the logits themselves are O(10).
pytestmark = pytest.mark.model

LOGIT_ATOL = FLOAT16_KV_LOGIT_ATOL


@pytest.fixture(scope="module")
def engine(downloader):
  eng = NumpyDynamicShardInferenceEngine(downloader)
  asyncio.run(eng.ensure_shard(smollm2_shard()))
  return eng


@pytest.fixture(scope="module")
def full_weights(smollm2_path):
  return load_shard_weights(smollm2_path, smollm2_shard())


def chat(engine, text):
  return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


async def greedy(engine, request_id, prompt, n):
  shard = smollm2_shard()
  logits, _ = await engine.infer_prompt(request_id, shard, prompt)
  tokens = []
  for _ in range(n):
    token = int(np.argmax(logits[0, -1]))
    tokens.append(token)
    if token in engine.tokenizer.eos_token_ids:
      break
    await asyncio.sleep(0)  # run concurrently, requests take turns token by token
    logits, _ = await engine.infer_tensor(request_id, shard, np.array([[token]]))
  await engine.finish_request(request_id)
  return tokens


@pytest.mark.parametrize("question, expected", [
  ("What is the capital of France?", "The capital of France is Paris."),
  ("What is 2 + 2?", "The answer to this classic math problem is 4."),
])
async def test_greedy_answers(engine, question, expected):
  tokens = await greedy(engine, f"q-{question}", chat(engine, question), 24)
  assert engine.tokenizer.decode(tokens).startswith(expected)


async def test_output_shapes(engine):
  logits, state = await engine.infer_prompt("shapes", smollm2_shard(), "Hello there")
  assert logits.shape == (1, 1, 49152) and logits.dtype == np.float32
  assert state is None
  await engine.finish_request("shapes")


def test_kv_cache_matches_full_recomputation(full_weights):
  config, weights = full_weights
  model = Llama(config, smollm2_shard(), weights)
  ids = np.array([1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198, 504, 3575])
  cache = model.new_cache()
  incremental = [model.forward([ids[:10]], [cache])[0]]
  for i in range(10, len(ids)):
    incremental.append(model.forward([ids[i:i + 1]], [cache])[0])
  for i, logits in enumerate(incremental):
    full = model.forward([ids[:10 + i]], [model.new_cache()])[0]
    np.testing.assert_allclose(logits, full, atol=LOGIT_ATOL)


def test_two_shards_equal_whole_model(full_weights, smollm2_path):
  config, weights = full_weights
  ids = np.array([1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47])
  whole_model = Llama(config, smollm2_shard(), weights)
  whole = whole_model.forward([ids], [whole_model.new_cache()])[0]
  first = Llama(config, smollm2_shard(0, 11), load_shard_weights(smollm2_path, smollm2_shard(0, 11))[1])
  second_weights = load_shard_weights(smollm2_path, smollm2_shard(12, 29))[1]
  assert not any(k.startswith("model.layers.0.") for k in second_weights), "a shard loads only its own layers"
  second = Llama(config, smollm2_shard(12, 29), second_weights)
  hidden = first.forward([ids], [first.new_cache()])[0]
  assert hidden.shape == (len(ids), config.hidden_size)
  split = second.forward([hidden], [second.new_cache()])[0]
  np.testing.assert_allclose(split, whole, atol=LOGIT_ATOL)


async def test_interleaved_requests_match_alone(engine):
  questions = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?", "Say hello.",
               "What is the largest planet?", "Who wrote Hamlet?", "What is water made of?", "Count to three."]
  prompts = [chat(engine, q) for q in questions]
  n = 12
  alone = [await greedy(engine, f"alone-{i}", p, n) for i, p in enumerate(prompts)]

  mixed = await asyncio.gather(*[greedy(engine, f"mixed-{i}", p, n) for i, p in enumerate(prompts)])
  assert mixed == alone


async def test_kv_cache_memory_returns_to_zero(engine):
  shard = smollm2_shard()
  for i in range(3):
    await engine.infer_prompt(f"mem-{i}", shard, "Hello " * (i + 1))
  assert engine.kv_cache_bytes() > 0
  for i in range(3):
    await engine.finish_request(f"mem-{i}")
  assert engine.kv_cache_bytes() == 0


def pool_resident_bytes(pool) -> int:
  """Resident bytes of the pool's slabs, page by page (mincore(2)). Not /proc/self/smaps: the kernel merges a slab's
  mapping with a neighbouring one of the same flags (another pool's, left by an earlier test), and smaps then counts
  the neighbour's pages as the slab's."""
  libc = ctypes.CDLL(None, use_errno=True)
  total = 0
  for slab in pool.slabs:
    pages = -(-slab.nbytes // mmap.PAGESIZE)
    resident = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(slab.ctypes.data), ctypes.c_size_t(slab.nbytes), resident) == 0, os.strerror(ctypes.get_errno())
    total += int(np.count_nonzero(np.frombuffer(resident, np.uint8) & 1)) * mmap.PAGESIZE
  return total


async def test_cache_memory_grows_with_use_and_returns_when_requests_end(engine):
  shard = smollm2_shard()
  await engine.infer_prompt("grow", shard, "Hi")
  small = engine.request_kv_bytes("grow")
  assert 0 < small < engine.caches["grow"].pool.slot_bytes / 64
  await engine.infer_prompt("grow", shard, "word " * 100)
  assert engine.request_kv_bytes("grow") > small and engine.kv_cache_bytes() == engine.request_kv_bytes("grow")
  await engine.finish_request("grow")
  assert engine.request_kv_bytes("grow") == 0 and engine.kv_cache_bytes() == 0

  model = engine.model
  caches = [model.new_cache() for _ in range(40)]  # room for 40 whole contexts: 7.5 GB of address space
  assert len({c.slot for c in caches}) == 40 and model.pool.slot_bytes * 40 > 7e9
  assert pool_resident_bytes(model.pool) < 1e6  # only what is written takes memory
  ids = np.array(engine.tokenizer.encode("word " * 300), dtype=np.int64)[:256]
  model.forward([ids] * 8, caches[:8])
  written = pool_resident_bytes(model.pool)
  assert written >= sum(c.nbytes for c in caches[:8]) > 0
  del caches
  assert pool_resident_bytes(model.pool) < written / 4, "a finished request's pages go back to the kernel"
  assert model.new_cache().slot == 0, "the lowest free slot is taken first"


async def test_a_step_shared_among_the_cores_matches_each_request_alone(engine, monkeypatch):
  """16 requests' decode steps of 16 rows, through llama.py's layers (columns and attention shared among the engine's
  threads), and, where OpenMP's threads are there to share it, through the fused pass (one compiled call, the panel
  kernel's products): each request's greedy tokens alone, both ways."""
  from exo.inference.numpy import attention, llama, packed
  from tests.support.engines import OPENINGS, batched, greedy, prompt_ids
  prompts = prompt_ids(engine, OPENINGS + [f"{opening} (again)" for opening in OPENINGS])  # 16: decode steps of 16 rows
  alone = [await greedy(engine, f"alone-{i}", ids, 6, stop_at_eos=False) for i, ids in enumerate(prompts)]
  steps, original = [], llama.Step
  monkeypatch.setattr(llama, "Step", lambda *args: steps.append(original(*args)) or steps[-1])
  monkeypatch.setattr(engine.model, "shared_decode", None)  # no step shared among OpenMP's threads: llama.py's layers
  assert await batched(engine, prompts, 6, "cores", join_every=0, stop_at_eos=False) == alone
  if attention.CORES > 1:
    assert len(steps) == 6 and all(len(step.job_groups) == attention.CORES for step in steps), "each step's attention was shared among the cores"
  assert engine.kv_cache_bytes() == 0

  if packed._parallel["usable"]:
    class Shared(packed.SharedDecode):
      def choose(self, rows):
        super().choose(rows)
        return True, False
    whole, step = [], engine.model.fused_decode.step
    monkeypatch.setattr(engine.model, "shared_decode", Shared())
    def noted(inputs, caches):
      out = step(inputs, caches)
      if out is not None:  # (a prompt's step is not the fused pass's: None)
        whole.append(len(inputs))
      return out
    monkeypatch.setattr(engine.model.fused_decode, "step", noted)
    assert await batched(engine, prompts, 6, "fused", join_every=0, stop_at_eos=False) == alone
    assert whole.count(len(prompts)) == 5, "each decode step of 16 rows taken by the fused pass"
    assert engine.kv_cache_bytes() == 0


async def test_a_request_past_the_context_is_refused_alone(engine):
  shard = smollm2_shard()
  context = engine.model.config.max_position_embeddings
  results = await engine.infer_batch(shard, [("long", np.ones((1, context + 1), dtype=np.int64), None), ("short", np.array([[42]]), None)])
  assert isinstance(results[0], ValueError) and "context" in str(results[0])
  assert results[1][0].shape == (1, 1, 49152) and "long" not in engine.caches
  await engine.finish_request("short")


async def test_batched_attention_matches_each_request_alone(engine):
  from tests.support.engines import check_batched_logits_match_alone
  await check_batched_logits_match_alone(engine)  # mixed lengths, chunked prompts, requests joining mid-flight


SERVE_ONE_REQUEST = """
import asyncio, json, sys
import numpy as np
from exo.download.shard_download import HFShardDownloader
from exo.inference.numpy.engine import NumpyDynamicShardInferenceEngine
from tests.support.models import smollm2_shard

async def main():
  engine = NumpyDynamicShardInferenceEngine(HFShardDownloader())
  shard = smollm2_shard()
  await engine.ensure_shard(shard)
  prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], tokenize=False,
                                                add_generation_prompt=True)
  logits, _ = await engine.infer_prompt("r", shard, prompt)
  tokens = []
  for _ in range(8):
    tokens.append(int(np.argmax(logits[0, -1])))
    logits, _ = await engine.infer_tensor("r", shard, np.array([[tokens[-1]]]))
  print(json.dumps({"tokens": tokens, "modules": sorted({name.split(".")[0] for name in sys.modules})}))

asyncio.run(main())
"""


def serve_one_request(**env) -> tuple:
  """Greedy tokens of one request served by a fresh interpreter's numpy engine, the top-level modules it imported, and
  what it wrote to stderr."""
  import json
  import os
  import subprocess
  import sys
  done = subprocess.run([sys.executable, "-c", SERVE_ONE_REQUEST], capture_output=True, text=True, timeout=300, env={**os.environ, **env},
                        cwd=Path(__file__).resolve().parent.parent)
  assert done.returncode == 0, done.stderr
  result = json.loads(done.stdout.strip().splitlines()[-1])
  return result["tokens"], set(result["modules"]), done.stderr


def test_without_a_c_compiler_the_engine_warns_once_and_answers_as_with_its_compiled_kernels(tmp_path):
  """Neither numba nor llvmlite in a process serving a request; with no working compiler (CC a command that fails, an
  empty kernels cache) numpy's forms give the same greedy answer, after one warning."""
  compiled, modules, _ = serve_one_request()
  assert not modules & {"numba", "llvmlite"}
  fallback, _, stderr = serve_one_request(CC="false", EXO_HOME=str(tmp_path))
  assert fallback == compiled
  assert stderr.count("kernels run in numpy") == 1, stderr
  assert not (tmp_path / "kernels").exists() or not list((tmp_path / "kernels").glob("*.so"))


def test_where_exo_home_cannot_be_written_the_kernels_are_built_in_a_private_temporary_folder(tmp_path, monkeypatch):
  """EXO_HOME below a plain file (no folder can be made there, even as root): the library is built in the user's own
  temporary folder, and loads."""
  from exo.inference.numpy import native
  (tmp_path / "file").write_text("")
  monkeypatch.setenv("EXO_HOME", str(tmp_path / "file" / "home"))
  monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
  (tmp_path / "tmp").mkdir()
  monkeypatch.setattr(native, "_state", {})
  assert native.library() is not None
  [built] = (tmp_path / "tmp").glob("exo-kernels-*/exo-kernels-*.so")
  assert oct(built.parent.stat().st_mode & 0o777) == oct(0o700)


def test_a_temporary_folder_another_user_can_write_is_not_used(tmp_path, monkeypatch):
  from exo.inference.numpy import native
  monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path))
  shared = tmp_path / f"exo-kernels-{os.getuid()}"
  shared.mkdir()
  shared.chmod(0o777)
  assert shared not in native.library_folders()
  shared.chmod(0o700)
  assert shared in native.library_folders()

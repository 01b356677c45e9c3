"""mlx-community style checkpoints (mlx-lm's own 8-bit and 4-bit conversions of the embedded SmolLM2), named by
path: `exo run PATH --inference-engine mlx`, alone and split over a 2-process ring, answers exactly as mlx-lm's own
generate does; the numpy engine loads the same files; the 4-bit model holds a fraction of the float32 one's memory;
the API serves the path and refuses paths its operator did not allow."""
import asyncio
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import grpc
import numpy as np
import pytest

import exo.inference.mlx  # noqa: F401  (first: it binds OpenBLAS, which must precede mlx.core)

pytest.importorskip("mlx.core")  # CI installs it; this only spares machines without the package

from exo.download.shard_download import HFShardDownloader  # noqa: E402
from exo.inference.engines import get_inference_engine  # noqa: E402
from exo.inference.quantized import QuantizedWeight  # noqa: E402
from exo.inference.shard import Shard  # noqa: E402
from exo.inference.tokenizers import resolve_tokenizer  # noqa: E402
from exo.inference.weights import load_shard_weights  # noqa: E402
from exo.networking.grpc import node_service_pb2 as pb  # noqa: E402
from exo.networking.grpc import node_service_pb2_grpc as pb_grpc  # noqa: E402
from tests.support.api_server import ApiServer  # noqa: E402
from tests.support.checkpoints import served_checkpoints  # noqa: E402
from tests.support.cluster import REPO, ExoProcess, free_port, run_answers, wait_for_ring, write_manual_config  # noqa: E402
from tests.support.models import SMOLLM2_LAYERS  # noqa: E402

pytestmark = pytest.mark.cluster

PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea."]
MAX_TOKENS = 24


def templated_ids(tokenizer, prompt: str):
  text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
  return tokenizer.encode(text)


def mlx_lm_answers(checkpoints) -> dict:
  from mlx_lm import load, stream_generate
  answers = {}
  for kind in ("q8", "q4"):
    tokenizer = resolve_tokenizer(checkpoints[kind])
    model, mlx_tokenizer = load(str(checkpoints[kind]))
    answers[kind] = []
    for prompt in PROMPTS:
      tokens = [r.token for r in stream_generate(model, mlx_tokenizer, templated_ids(tokenizer, prompt), max_tokens=MAX_TOKENS)]
      answers[kind].append(tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids]))
  return answers


@pytest.fixture(scope="module")
def reference(smollm2_checkpoints):
  """mlx-lm's own greedy answers on each quantized checkpoint, for the same prompt tokens exo sends: computed on a
  thread while the first tests' exo processes run (one core each), read with .result()."""
  with ThreadPoolExecutor(max_workers=1) as pool:
    yield pool.submit(mlx_lm_answers, smollm2_checkpoints)


def answers_printed(output: str):
  return run_answers(output, PROMPTS)


def run_args(path) -> list:
  return ["run", str(path), "--inference-engine", "mlx", "--max-generate-tokens", str(MAX_TOKENS), *[a for p in PROMPTS for a in ("--prompt", p)]]


@pytest.mark.parametrize("kind", ["q8"])  # the 4-bit model takes the same exo run path split over two processes below
def test_exo_run_path_answers_as_mlx_lm(smollm2_checkpoints, reference, tmp_path, kind):
  node = ExoProcess("alone", run_args(smollm2_checkpoints[kind]), tmp_path)
  assert node.start().wait(240) == 0, node.log()[-3000:]
  assert answers_printed(node.log()) == reference.result(timeout=600)[kind]


@pytest.fixture(scope="module")
def ring_peer(smollm2_checkpoints, tmp_path_factory):
  """A server node that serves every checkpoint under the checkpoints' directory (--models-dir), for `exo run`
  drivers to form a 2-node ring with."""
  workdir = tmp_path_factory.mktemp("ring")
  ports = {"node-a": free_port(), "node-b": free_port()}
  config = write_manual_config(workdir / "peers.json", ports)
  peer = ExoProcess("node-b", ["--inference-engine", "mlx", "--models-dir", str(smollm2_checkpoints["q4"].parent), "--node-host", "127.0.0.1",
                               "--node-port", str(ports["node-b"]), "--chatgpt-api-port", str(free_port()), "--discovery-module", "manual",
                               "--discovery-config-path", str(config), "--disable-tui"], workdir, {"DEBUG": "5"})  # 5: it logs each forward
  peer.start()
  try:
    asyncio.run(wait_for_ring({"node-b": ports["node-b"]}, 60, [peer]))  # a ring of one: its gRPC answers
    yield peer, ports, config, workdir
  finally:
    peer.stop()


@pytest.mark.parametrize("kind", ["q4"])  # the 8-bit model takes the same exo run path alone above
def test_exo_run_path_split_over_two_processes_answers_as_mlx_lm(smollm2_checkpoints, reference, ring_peer, kind):
  peer, ports, config, workdir = ring_peer
  before = len(peer.log())
  driver = ExoProcess("node-a", run_args(smollm2_checkpoints[kind]) + [
    "--node-host", "127.0.0.1", "--node-port", str(ports["node-a"]), "--discovery-module", "manual",
    "--discovery-config-path", str(config), "--wait-for-peers", "1"], workdir / kind)
  try:
    assert driver.start().wait(240) == 0, driver.log()[-3000:]
  finally:
    driver.stop()
    # The peer must see the driver leave before the next one joins, or that one's request meets a changing ring.
    asyncio.run(wait_for_ring({"node-b": ports["node-b"]}, 30, [peer]))
  assert answers_printed(driver.log()) == reference.result(timeout=600)[kind]
  # The peer did its half: it forwarded hidden states to node-a, or sampled the tokens itself.
  assert re.search(r"forward (tensor|prompt) .* to node-a|\] token \d+ ", peer.log()[before:]), peer.log()[-3000:]


async def test_a_peer_refuses_a_path_it_does_not_serve(ring_peer):
  _, ports, _, _ = ring_peer
  request = pb.PromptRequest(shard=pb.Shard(model_id="/etc", start_layer=0, end_layer=14, n_layers=30), prompt="x", request_id="r")
  async with grpc.aio.insecure_channel(f"127.0.0.1:{ports['node-b']}") as channel:
    with pytest.raises(grpc.aio.AioRpcError) as error:
      await pb_grpc.NodeServiceStub(channel).SendPrompt(request, timeout=10)
  assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a checkpoint this node serves" in error.value.details()


def full_shard(path) -> Shard:
  return Shard(str(path), 0, SMOLLM2_LAYERS - 1, SMOLLM2_LAYERS)


async def prompt_logits(engine_name: str, path, prompt_ids, request_id: str):
  engine = get_inference_engine(engine_name, HFShardDownloader())
  out, _ = await engine.infer_tensor(request_id, full_shard(path), np.array(prompt_ids)[None])
  step, _ = await engine.infer_tensor(request_id, full_shard(path), np.array([[int(out.argmax())]]))  # one decode row
  return out, step


@pytest.mark.parametrize("kind", ["q8", "q4"])
async def test_numpy_engine_loads_the_same_checkpoint_with_logits_close_to_mlx(smollm2_checkpoints, kind):
  with served_checkpoints() as local:
    local.serve([str(smollm2_checkpoints[kind])])
    ids = templated_ids(resolve_tokenizer(smollm2_checkpoints[kind]), PROMPTS[0])
    mlx_prefill, mlx_step = await prompt_logits("mlx", smollm2_checkpoints[kind], ids, f"mlx-{kind}")
    numpy_prefill, numpy_step = await prompt_logits("numpy", smollm2_checkpoints[kind], ids, f"numpy-{kind}")
  # The same dequantised values either way; only float32 summation order differs (logits are O(10)).
  np.testing.assert_allclose(numpy_prefill, mlx_prefill, atol=2e-3)
  np.testing.assert_allclose(numpy_step, mlx_step, atol=2e-3)


def test_mixed_precision_overrides_are_read_and_match_mlx_lm(smollm2_checkpoints):
  """Per-layer overrides: v_proj at 8 bits (groups of 32) beside 4-bit q/k, one layer left in float."""
  import mlx.core as mx
  from mlx_lm import load

  from exo.inference.mlx.llama import Llama
  path = smollm2_checkpoints["mixed"]
  config, weights = load_shard_weights(path, full_shard(path), keep_quantized=True)
  v, q = weights["model.layers.3.self_attn.v_proj.weight"], weights["model.layers.3.self_attn.q_proj.weight"]
  assert (v.bits, v.group_size, q.bits, q.group_size) == (8, 32, 4, 64)
  assert not isinstance(weights["model.layers.0.mlp.down_proj.weight"], QuantizedWeight)
  ours = Llama(config, full_shard(path), weights)
  ids = templated_ids(resolve_tokenizer(path), PROMPTS[1])
  got = ours.forward([np.array(ids)], [ours.new_cache()])[0][0]
  model, _ = load(str(path))
  np.testing.assert_allclose(got, np.array(model(mx.array(ids)[None])[0, -1]), atol=2e-3)


def test_a_shard_reads_only_its_own_quantized_layers(smollm2_checkpoints):
  path = smollm2_checkpoints["q4"]
  _, middle = load_shard_weights(path, Shard(str(path), 10, 19, SMOLLM2_LAYERS), keep_quantized=True)
  assert {int(n.split(".")[2]) for n in middle} == set(range(10, 20))
  assert all(isinstance(w, QuantizedWeight) for n, w in middle.items() if "proj" in n)
  _, last = load_shard_weights(path, Shard(str(path), 20, 29, SMOLLM2_LAYERS), keep_quantized=True)
  assert isinstance(last["model.embed_tokens.weight"], QuantizedWeight)  # the tied head is the quantized embedding


RESIDENT = """
import asyncio, sys, psutil
import exo.inference.mlx
from exo.download.shard_download import HFShardDownloader
from exo.inference.mlx.engine import MLXDynamicShardInferenceEngine
from exo.inference.shard import Shard
from exo.local_checkpoints import serve
serve([sys.argv[1]])
engine = MLXDynamicShardInferenceEngine(HFShardDownloader())
asyncio.run(engine.ensure_shard(Shard(sys.argv[1], 0, 29, 30)))
print(psutil.Process().memory_info().rss)
"""


def test_mlx_holds_the_4bit_checkpoint_in_under_0_4x_the_float32_ones_memory(smollm2_checkpoints):
  resident = {}
  for kind in ("fp32", "q4"):  # each in a fresh process: resident memory after loading, as a user's node has it
    run = subprocess.run([sys.executable, "-c", RESIDENT, str(smollm2_checkpoints[kind])], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    resident[kind] = int(run.stdout.split()[-1])
  print(f"resident after load: fp32 {resident['fp32'] / 2**20:.0f} MiB, 4-bit {resident['q4'] / 2**20:.0f} MiB", file=sys.stderr)
  assert resident["q4"] <= 0.4 * resident["fp32"], resident


@pytest.fixture(scope="module")
def api(smollm2_checkpoints):
  """An MLX node whose operator serves the 4-bit checkpoint as its default model."""
  with served_checkpoints() as local:
    default = local.serve([str(smollm2_checkpoints["q4"])], [str(smollm2_checkpoints["q4"].parent)])[0]
    server = ApiServer("mlx", default_model=default).start()
    try:
      yield server, default
    finally:
      server.stop()


async def post_chat(url: str, model: str, content: str, **extra):
  body = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as response:
      return response.status, await response.json()


async def test_the_api_serves_the_path_and_lists_it(api, reference):
  server, model = api
  status, reply = await post_chat(server.url, model, PROMPTS[0], max_tokens=MAX_TOKENS)
  assert status == 200 and reply["model"] == model, reply
  assert reply["choices"][0]["message"]["content"] == reference.result(timeout=600)["q4"][0]
  async with aiohttp.ClientSession() as session:
    async with session.get(f"{server.url}/v1/models") as response:
      assert model in [m["id"] for m in (await response.json())["data"]]


async def test_the_api_refuses_paths_its_operator_did_not_allow(api, smollm2_checkpoints):
  server, model = api
  for path, why in [("/etc/passwd", "not a checkpoint this node serves"), (str(smollm2_checkpoints["q4"].parent / ".." / "x"), "not a checkpoint this node serves"),
                    (str(smollm2_checkpoints["q4"].parent / "nothing-here"), "not a checkpoint (expected")]:
    status, reply = await post_chat(server.url, path, "Hi")
    assert status == 400 and why in json.dumps(reply), (path, reply)
  status, _ = await post_chat(server.url, model, "Hi", max_tokens=2)
  assert status == 200

"""Downloads a user can trust, tried as a user meets them: real `exo` processes fetching a model through HF_ENDPOINT
from a stand-in hub (tests/support/stand_in_hub.py) that serves a random-weight Llama in the layout of
`unsloth/Llama-3.2-1B-Instruct` (the numpy engine's repository for llama-3.2-1b), over HTTP, with the faults a
real hub and network have: progress while bytes arrive, a dropped connection, the hub down then back, concurrent
requests, a node killed mid-download, a missing file, bytes that differ from what the hub announced, a gated
repository, a full disk, offline mode, `exo run`, and a 2-node ring whose nodes each fetch their own layers.

Failure times are bounded (FAILURE_BOUND_S below; docs/downloads.md gives the bound of each kind)."""
import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.support.checkpoints import write_layer_split_llama
from tests.support.cluster import REPO as CHECKOUT, Cluster, free_port, wait_for_ring
from tests.support.stand_in_hub import StandInHub
from tests.support.waiting import eventually

pytestmark = pytest.mark.cluster

MODEL, REPO, LAYERS = "llama-3.2-1b", "unsloth/Llama-3.2-1B-Instruct", 16
FOLDER = "unsloth--Llama-3.2-1B-Instruct"
BIG = "model-00003-of-00003.safetensors"  # embeddings and final norm: most of the bytes
# A hub that refuses connections or answers 5xx fails a request after 3 tries 0.5 s and 1 s apart; the rest of this
# bound is the time a loaded two-core VM takes to start the work.
FAILURE_BOUND_S = 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
  return write_layer_split_llama(tmp_path_factory.mktemp("llama") / REPO.split("/")[1], LAYERS)


@pytest.fixture
def hub(checkpoint):
  hub = StandInHub().start()
  hub.add_repo(REPO, checkpoint)
  try:
    yield hub
  finally:
    hub.stop()


def hub_env(hub: StandInHub, tmp_path: Path, **extra) -> dict:
  """A node's environment: the stand-in hub as its mirror, and no Hugging Face token or cache of the machine's own."""
  return {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf_home"), "HF_TOKEN": "", **extra}


@asynccontextmanager
async def node(tmp_path: Path, env: dict, ids=("solo",)):
  tmp_path.mkdir(parents=True, exist_ok=True)
  cluster = Cluster(tmp_path, list(ids), "numpy", env)
  try:
    await cluster.start()
    yield cluster
  finally:
    cluster.stop()


async def call(method: str, url: str, body=None, timeout: float = 120):
  async with aiohttp.ClientSession() as session:
    async with session.request(method, url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
      return response.status, await response.json()


async def timed_chat(url: str, model: str = MODEL, timeout: float = 120):
  """(status, body, seconds) of a short chat request."""
  started = time.monotonic()
  status, body = await call("POST", f"{url}/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                            timeout)
  return status, body, time.monotonic() - started


async def model_pool(url: str) -> dict:
  async with aiohttp.ClientSession() as session:
    async with session.get(f"{url}/modelpool") as response:
      text = await response.text()
  pool = {}
  for line in text.splitlines():
    if line.startswith("data: {"):
      pool.update(json.loads(line[6:]))
  return pool


def same_files(folder: Path, source: Path, names) -> None:
  for name in names:
    assert hashlib.sha256((folder / name).read_bytes()).digest() == hashlib.sha256((source / name).read_bytes()).digest(), name


def assert_download_error(status: int, body: dict, kind: str, expected_status: int, *words: str) -> str:
  assert status == expected_status, body
  error = body["error"]
  assert error["code"] == kind, error
  for word in (MODEL, REPO, *words):
    assert word in error["message"], (word, error["message"])
  return error["message"]


# --- the stand-in hub speaks what huggingface_hub asks ---

def test_huggingface_hubs_own_snapshot_download_reads_the_stand_in_hub(hub, checkpoint, tmp_path):
  from huggingface_hub import snapshot_download
  folder = Path(snapshot_download(REPO, local_dir=tmp_path / "copy", endpoint=hub.url, token=False))
  same_files(folder, checkpoint, [p.name for p in checkpoint.iterdir()])
  assert {r.path for r in hub.requests if r.method == "HEAD"} == {p.name for p in checkpoint.iterdir()}  # its metadata calls too


# --- progress ---

async def test_a_fresh_download_reports_progress_while_bytes_arrive(hub, checkpoint, tmp_path):
  hub.bytes_per_second = 3e6  # ~6 s for the ~17 MB the model's files weigh
  async with node(tmp_path, hub_env(hub, tmp_path)) as cluster:
    url = cluster.url("solo")
    assert (await call("POST", f"{url}/download", {"model": MODEL}))[0] == 200
    seen, deadline = [], time.monotonic() + 120
    while not (await model_pool(url)).get(MODEL, {}).get("downloaded"):
      download = (await call("GET", f"{url}/v1/downloads"))[1].get(MODEL, {})
      assert download.get("status") != "failed", download.get("error")  # say why, rather than wait out the deadline
      assert time.monotonic() < deadline, f"not downloaded within 120 s: {seen[-1:]}, {download}"
      _, progress = await call("GET", f"{url}/v1/download/progress")
      if "solo" in progress:
        seen.append(progress["solo"])
      await asyncio.sleep(0.1)
    between = [p for p in seen if 0 < p["downloaded_bytes"] < p["total_bytes"]]
    assert len({p["downloaded_bytes"] for p in between}) >= 3, [p["downloaded_bytes"] for p in seen]
    assert [p["downloaded_bytes"] for p in between] == sorted(p["downloaded_bytes"] for p in between)
    assert all(p["status"] == "in_progress" and p["repo_id"] == REPO and p["total_bytes"] == between[0]["total_bytes"] for p in between)
    assert any(p["overall_speed"] > 0 and p["overall_eta"] > 0 for p in between)
    files = [p["file_progress"][BIG] for p in between]
    assert any(0 < f["downloaded"] < f["total"] and f["status"] == "in_progress" and f["speed"] > 0 for f in files), files
    downloads = (await call("GET", f"{url}/v1/downloads"))[1]
    assert downloads[MODEL]["status"] == "complete" and downloads[MODEL]["error"] is None
    status, body, _ = await timed_chat(url)
    assert status == 200, body
    same_files(cluster.nodes["solo"].home / "downloads" / FOLDER, checkpoint, [p.name for p in checkpoint.iterdir()])


# --- failures that say what happened, and heal ---

@pytest.mark.parametrize("refuse", [True, False], ids=["refused", "503"])
async def test_the_hub_down_fails_requests_clearly_and_the_next_one_after_it_is_back_succeeds(hub, tmp_path, refuse):
  async with node(tmp_path, hub_env(hub, tmp_path)) as cluster:
    url = cluster.url("solo")
    hub.go_down(refuse)
    status, body, seconds = await timed_chat(url)
    message = assert_download_error(status, body, "hub_unreachable", 502, hub.url, "3 tries")
    assert seconds < FAILURE_BOUND_S, seconds
    print(f"hub down ({'refused' if refuse else '503'}): {status} in {seconds:.2f} s: {message}")
    pool = (await model_pool(url))[MODEL]
    assert pool["downloaded"] is False and pool["download_percentage"] < 100  # a failure is never listed as on disk
    assert (await call("GET", f"{url}/v1/downloads"))[1][MODEL]["error"]["code"] == "hub_unreachable"
    hub.come_back()
    status, body, _ = await timed_chat(url)
    assert status == 200, body  # no restart
    assert (await model_pool(url))[MODEL]["downloaded"] is True


async def test_a_dropped_connection_resumes_where_it_broke(hub, checkpoint, tmp_path):
  hub.drops[BIG] = 3 << 20
  async with node(tmp_path, hub_env(hub, tmp_path)) as cluster:
    status, body, _ = await timed_chat(cluster.url("solo"))
    assert status == 200, body
    first, resumed = hub.fetches(BIG)  # from the start, then from where it broke (less what the client had not yet read)
    assert first is None and 0 < int(resumed.removeprefix("bytes=").rstrip("-")) <= 3 << 20, hub.fetches(BIG)
    same_files(cluster.nodes["solo"].home / "downloads" / FOLDER, checkpoint, [BIG])


async def test_concurrent_requests_share_one_download_and_a_waiter_may_leave(hub, tmp_path):
  hub.bytes_per_second = 4e6
  async with node(tmp_path, hub_env(hub, tmp_path)) as cluster:
    url = cluster.url("solo")
    leaving = asyncio.ensure_future(timed_chat(url, timeout=1.0))  # its client gives up while the files arrive
    replies = await asyncio.gather(timed_chat(url), timed_chat(url), timed_chat(url))
    with pytest.raises(asyncio.TimeoutError):
      await leaving
    assert [status for status, _, _ in replies] == [200, 200, 200], replies
    assert len([r for r in hub.requests if r.path == "model_info"]) == 1  # one listing: one download
    assert all(len(hub.fetches(name)) == 1 for name in hub.repos[REPO].files), hub.requests


async def test_a_node_killed_mid_download_resumes_after_its_restart(hub, checkpoint, tmp_path):
  hub.bytes_per_second = 3e6
  async with node(tmp_path, hub_env(hub, tmp_path)) as cluster:
    url, solo = cluster.url("solo"), cluster.nodes["solo"]
    assert (await call("POST", f"{url}/download", {"model": MODEL}))[0] == 200
    partial = solo.home / "downloads" / FOLDER / f"{BIG}.partial"
    await eventually(lambda: partial.exists() and partial.stat().st_size > 2 << 20, 60, "the big file under way")
    solo.kill()
    kept = partial.stat().st_size
    hub.bytes_per_second = None
    await cluster.start()
    status, body, _ = await timed_chat(url)
    assert status == 200, body
    resumed_from = int(hub.fetches(BIG)[-1].removeprefix("bytes=").rstrip("-"))
    assert hub.fetches(BIG)[0] is None and resumed_from >= kept, (hub.fetches(BIG), kept)
    same_files(solo.home / "downloads" / FOLDER, checkpoint, [p.name for p in checkpoint.iterdir()])


async def test_a_missing_repository_or_file_and_bytes_that_differ_fail_clearly_every_time_until_the_hub_is_fixed(hub, checkpoint, tmp_path):
  repo = hub.repos[REPO]
  async with node(tmp_path, hub_env(hub, tmp_path)) as cluster:
    url = cluster.url("solo")
    status, body, seconds = await timed_chat(url, "llama-3.2-3b")  # its repository is not on the hub
    assert status == 502 and body["error"]["code"] == "repo_not_found" and "unsloth/Llama-3.2-3B-Instruct" in body["error"]["message"], body
    print(f"repository not found: {status} in {seconds:.2f} s: {body['error']['message']}")
    repo.unserved.add(BIG)
    for _ in range(2):  # not remembered as complete, nor as failed: each request tries again
      status, body, seconds = await timed_chat(url)
      message = assert_download_error(status, body, "file_not_found", 502, BIG)
      assert seconds < FAILURE_BOUND_S, seconds
    print(f"missing file: {status} in {seconds:.2f} s: {message}")
    repo.unserved.clear()
    good = repo.files[BIG]
    repo.served_instead[BIG] = good[:1000] + bytes([good[1000] ^ 0xFF]) + good[1001:]  # one byte flipped, same size
    status, body, seconds = await timed_chat(url)
    message = assert_download_error(status, body, "corrupt", 502, BIG, "hashes to")
    print(f"bytes differ: {status} in {seconds:.2f} s: {message}")
    folder = cluster.nodes["solo"].home / "downloads" / FOLDER
    assert not (folder / BIG).exists() and not (folder / f"{BIG}.partial").exists()  # the bad bytes are not kept
    assert (await model_pool(url))[MODEL]["downloaded"] is False
    repo.served_instead.clear()
    status, body, _ = await timed_chat(url)
    assert status == 200, body
    same_files(folder, checkpoint, [BIG])


async def test_a_gated_repository_needs_hf_token(hub, tmp_path):
  hub.repos[REPO].gated_token = "hf_secret"
  async with node(tmp_path / "without", hub_env(hub, tmp_path)) as cluster:
    status, body, seconds = await timed_chat(cluster.url("solo"))
    message = assert_download_error(status, body, "gated", 502, "HF_TOKEN")
    print(f"gated without HF_TOKEN: {status} in {seconds:.2f} s: {message}")
  async with node(tmp_path / "with", hub_env(hub, tmp_path, HF_TOKEN="hf_secret")) as cluster:
    status, body, _ = await timed_chat(cluster.url("solo"))
    assert status == 200, body


def _can_mount_a_small_disk() -> bool:
  if shutil.which("unshare") is None:
    return False
  return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /tmp"], capture_output=True).returncode == 0


async def test_a_full_disk_is_named(hub, tmp_path):
  if not _can_mount_a_small_disk():
    pytest.skip("needs `unshare -rm` and a tmpfs mount (user namespaces) to give the node a small disk")
  cluster = Cluster(tmp_path, ["solo"], "numpy", hub_env(hub, tmp_path))
  solo = cluster.nodes["solo"]
  (solo.home / "downloads").mkdir(parents=True)
  # The node's downloads folder on a 4 MiB disk of its own (a mount namespace: nothing else sees it).
  solo.prefix = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=4m tmpfs "{solo.home / "downloads"}" && exec "$@"', "sh"]
  try:
    await cluster.start()
    status, body, seconds = await timed_chat(cluster.url("solo"))
    message = assert_download_error(status, body, "disk_full", 507, "free")
    print(f"disk full: {status} in {seconds:.2f} s: {message}")
  finally:
    cluster.stop()


async def test_offline_serves_what_is_complete_and_refuses_the_rest_at_once(hub, tmp_path):
  async with node(tmp_path, hub_env(hub, tmp_path)) as cluster:
    url, solo = cluster.url("solo"), cluster.nodes["solo"]
    assert (await timed_chat(url))[0] == 200
    solo.stop()
    solo.extra_env["HF_HUB_OFFLINE"] = "1"
    asked = len(hub.requests)
    await cluster.start()
    status, body, _ = await timed_chat(url)
    assert status == 200, body
    status, body, seconds = await timed_chat(url, "llama-3.2-3b")
    assert status == 503 and body["error"]["code"] == "offline", body
    assert "HF_HUB_OFFLINE=1" in body["error"]["message"] and "unsloth/Llama-3.2-3B-Instruct" in body["error"]["message"]
    assert seconds < 2, seconds
    print(f"offline, not on disk: {status} in {seconds:.2f} s: {body['error']['message']}")
    assert len(hub.requests) == asked  # nothing was asked of the hub


def test_exo_run_says_what_failed_in_one_line(tmp_path):
  dead = f"http://127.0.0.1:{free_port()}"
  started = time.monotonic()
  run = subprocess.run([sys.executable, "-m", "exo.main", "run", MODEL, "--inference-engine", "numpy", "--prompt", "hi"], cwd=CHECKOUT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "EXO_HOME": str(tmp_path), "HF_ENDPOINT": dead, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": ""})
  seconds = time.monotonic() - started
  lines = [line for line in run.stderr.splitlines() if not line.startswith(("exo: prefix cache", "exo: placement"))]  # the settings it starts with
  assert run.returncode == 1 and len(lines) == 1, run.stderr
  assert lines[0].startswith(f"exo: error: Could not download model {MODEL} (repository {REPO} from {dead})") and "hub unreachable" in lines[0]
  print(f"exo run, hub unreachable: exit {run.returncode} after {seconds:.2f} s (process start included): {lines[0]}")


# --- a ring ---

def layer_files(stages: list, node_id: str) -> set:
  """The checkpoint's files that hold the node's layers in this cut: its first file the first half, its second the rest."""
  return {f"model-0000{layer // (LAYERS // 2) + 1}-of-00003.safetensors"
          for s in stages if s["node_id"] == node_id for layer in range(s["start_layer"], s["end_layer"] + 1)}


async def test_a_ring_fails_with_the_peers_download_error_then_each_node_fetches_only_its_layers(hub, checkpoint, tmp_path):
  # b's token opens nothing (a gated repository): a failure its peers cannot cover for (a node that cannot reach the
  # hub would take the files from them, see test_peer_downloads.py).
  hub.repos[REPO].gated_token = "hf_secret"
  cluster = Cluster(tmp_path, ["ring-a", "ring-b"], "numpy", hub_env(hub, tmp_path, EXO_PLACEMENT="pipeline", HF_TOKEN="hf_secret"))  # a copy does fit one node
  b = cluster.nodes["ring-b"]
  b.extra_env = {**b.extra_env, "HF_TOKEN": ""}  # (the nodes share one env dict)
  try:
    await cluster.start()
    status, body, seconds = await timed_chat(cluster.url("ring-a"))
    message = assert_download_error(status, body, "gated", 502, "on node ring-b", "HF_TOKEN")
    print(f"ring, the peer's hub refuses it: {status} in {seconds:.2f} s: {message}")
    b.stop()
    await wait_for_ring({"ring-a": cluster.ports["ring-a"]}, 30)  # a has seen b leave: b's return is not a flap
    b.extra_env["HF_TOKEN"] = "hf_secret"
    await cluster.start(["ring-b"])  # returns once ring-a places requests over both nodes
    client = openai.AsyncOpenAI(base_url=f"{cluster.url('ring-a')}/v1", api_key="exo", max_retries=0, timeout=120)
    reply = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
    _, topology = await call("GET", f"{cluster.url('ring-a')}/v1/topology")
    stages = topology["placement"]["models"][MODEL]["groups"][0]["stages"]
    assert len(stages) == 2, stages
    weights = {node_id: {p.name for p in (process.home / "downloads" / FOLDER).glob("*.safetensors")} for node_id, process in cluster.nodes.items()}
    held = {node: w - {BIG} for node, w in weights.items()}
    assert held["ring-b"] == layer_files(stages, "ring-b"), (weights, stages)  # its own layers' files only
    # a holds its layers' files too; while b was away it was a pipeline of itself alone, placed to hold every layer.
    assert layer_files(stages, "ring-a") <= held["ring-a"], (weights, stages)
    assert all(BIG in w for w in weights.values())  # and the embeddings, which the first and (tied) the last node use
    for name in ("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors"):  # once from the hub: a node fetches what a peer holds from it
      assert len(hub.fetches(name)) == 1, (name, hub.fetches(name))
  finally:
    cluster.stop()

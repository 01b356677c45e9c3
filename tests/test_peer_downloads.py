"""A model crosses the internet once per cluster: real `exo` processes on loopback (manual discovery) and the stand-in
hub (tests/support/stand_in_hub.py), whose log says which files it served. A node fetches what a peer holds verified
from that peer; nodes downloading at once fetch each file from the hub once between them; a node offline or cut off
from the hub is served by its peers; a peer that dies mid-transfer or sends bad bytes costs a resume elsewhere; and a
client that is not a ring member gets 403 from a node's files (under /exo/files on its API server), whatever it asks."""
import asyncio
import os
import re
from contextlib import asynccontextmanager

import aiohttp
import pytest
from yarl import URL

from tests.support.cluster import Cluster, free_port
from tests.support.waiting import eventually
from tests.test_downloads import BIG, FOLDER, MODEL, REPO, call, checkpoint, hub, hub_env, model_pool, same_files  # noqa: F401 (fixtures)

pytestmark = pytest.mark.cluster



def all_files(checkpoint) -> list:
  return sorted(p.name for p in checkpoint.iterdir())


async def downloaded(cluster: Cluster, node_id: str, timeout: float = 180) -> None:
  """Until the node holds the model verified; fails at once, saying why, if its download failed."""
  url = cluster.url(node_id)

  async def done():
    download = (await call("GET", f"{url}/v1/downloads"))[1].get(MODEL, {})
    assert download.get("status") != "failed", (node_id, download.get("error"))
    cluster.nodes[node_id].check_running("its download ended")
    return (await model_pool(url)).get(MODEL, {}).get("downloaded")
  await eventually(done, timeout, f"{node_id} holds {MODEL}", interval=0.2)


async def download(cluster: Cluster, node_id: str) -> None:
  status, body = await call("POST", f"{cluster.url(node_id)}/download", {"model": MODEL})
  assert status == 200, body


@asynccontextmanager
async def a_holds_the_model(hub, tmp_path, **node_env):
  """A running cluster of nodes a and b (node_env: extra environment by node), a having downloaded the model."""
  cluster = Cluster(tmp_path, ["a", "b"], "numpy", hub_env(hub, tmp_path))
  for node_id, extra in node_env.items():
    cluster.nodes[node_id].extra_env = {**cluster.nodes[node_id].extra_env, **extra}  # (the nodes share one env dict)
  try:
    await cluster.start()
    await download(cluster, "a")
    await downloaded(cluster, "a")
    yield cluster
  finally:
    cluster.stop()


def files_from(downloads: dict) -> dict:
  return {path: (f["source"], f["peer"]) for path, f in downloads[MODEL]["files"].items()}


def hub_gets(hub) -> dict:
  return {name: len(hub.fetches(name)) for name in hub.repos[REPO].files}


async def test_a_node_fetches_what_a_peer_holds_from_the_peer_and_says_so(hub, checkpoint, tmp_path):
  async with a_holds_the_model(hub, tmp_path) as cluster:
    assert all(n == 1 for n in hub_gets(hub).values()), hub_gets(hub)
    await download(cluster, "b")
    await downloaded(cluster, "b")
    assert all(n == 1 for n in hub_gets(hub).values()), hub_gets(hub)  # b's bytes all came from a
    same_files(cluster.nodes["b"].home / "downloads" / FOLDER, checkpoint, all_files(checkpoint))
    files = (await call("GET", f"{cluster.url('b')}/v1/downloads"))[1][MODEL]["files"]
    assert files and all((f["source"], f["peer"]) == ("peer", "a") for f in files.values()), files
    assert files[BIG]["status"] == "complete" and files[BIG]["downloaded"] == files[BIG]["total"] and "peer a" in files[BIG]["from"]
    assert re.search(rf"exo: {BIG} from peer a .*MB/s\)", cluster.nodes["b"].current_log())


async def test_nodes_asked_at_once_fetch_each_file_from_the_hub_once_between_them(hub, checkpoint, tmp_path):
  hub.bytes_per_second = 3e6
  ids = ["a", "b", "c"]
  cluster = Cluster(tmp_path, ids, "numpy", hub_env(hub, tmp_path))
  try:
    await cluster.start()
    await asyncio.gather(*[download(cluster, node_id) for node_id in ids])
    await asyncio.gather(*[downloaded(cluster, node_id) for node_id in ids])
    assert all(n == 1 for n in hub_gets(hub).values()), hub_gets(hub)
    for node_id in ids:
      same_files(cluster.nodes[node_id].home / "downloads" / FOLDER, checkpoint, all_files(checkpoint))
    sources = {node_id: files_from((await call("GET", f"{cluster.url(node_id)}/v1/downloads"))[1]) for node_id in ids}
    for name in all_files(checkpoint):  # one node had it from the hub, the others from a peer
      assert sorted(s[name][0] for s in sources.values() if name in s).count("hub") <= 1, sources
  finally:
    cluster.stop()


@pytest.mark.parametrize("cut_off", ["offline", "no_route"])
async def test_a_node_that_cannot_reach_the_hub_gets_the_model_from_its_peers(hub, checkpoint, tmp_path, cut_off):
  cut = {"HF_HUB_OFFLINE": "1"} if cut_off == "offline" else {"HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
  async with a_holds_the_model(hub, tmp_path, b=cut) as cluster:
    asked = len(hub.requests)
    await download(cluster, "b")
    await downloaded(cluster, "b")
    assert len(hub.requests) == asked  # nothing of b's reached the hub
    same_files(cluster.nodes["b"].home / "downloads" / FOLDER, checkpoint, all_files(checkpoint))
    status, body = await call("POST", f"{cluster.url('b')}/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                                                                 "max_tokens": 2})
    assert status == 200, body


async def test_a_peer_that_dies_mid_transfer_costs_only_the_rest_of_the_file_from_the_hub(hub, checkpoint, tmp_path):
  async with a_holds_the_model(hub, tmp_path, a={"EXO_PEER_UPLOAD_BYTES_PER_S": "1000000"}) as cluster:  # slow enough to die part way through
    a, b = cluster.nodes["a"], cluster.nodes["b"]
    await download(cluster, "b")
    partial = b.home / "downloads" / FOLDER / f"{BIG}.partial"
    await eventually(lambda: partial.exists() and partial.stat().st_size > 1 << 20, 60, "b part way through the big file from a")

    async def shown_arriving_from_a():  # the ring's progress and b's own downloads say where it comes from, and how fast
      progress = (await call("GET", f"{cluster.url('a')}/v1/download/progress"))[1].get("b", {})
      files = (await call("GET", f"{cluster.url('b')}/v1/downloads"))[1][MODEL].get("files", {})
      return progress.get("file_sources", {}).get(BIG) == "peer a" and files.get(BIG, {}).get("source") == "peer" and files[BIG]["speed"] > 0
    await eventually(shown_arriving_from_a, 30, "b's download shown as coming from a")
    a.kill()
    await downloaded(cluster, "b")
    fetches = hub.fetches(BIG)
    assert len(fetches) == 2 and fetches[0] is None and int(fetches[1].removeprefix("bytes=").rstrip("-")) >= 1 << 20, fetches  # a's, then b's rest
    same_files(b.home / "downloads" / FOLDER, checkpoint, all_files(checkpoint))
    assert re.search(rf"exo: peer a .* failed to send {BIG}", b.current_log()), b.current_log()[-3000:]


async def test_a_peer_that_sends_bad_bytes_is_named_and_the_file_fetched_elsewhere(hub, checkpoint, tmp_path):
  async with a_holds_the_model(hub, tmp_path) as cluster:
    a, b = cluster.nodes["a"], cluster.nodes["b"]
    held = a.home / "downloads" / FOLDER / BIG
    data = bytearray(held.read_bytes())
    data[1000] ^= 0xFF  # rotted on a's disk: the same size, so a still announces it verified
    rotted = held.with_name(held.name + ".rotted")
    rotted.write_bytes(bytes(data))
    os.replace(rotted, held)  # at once: an announcement made while a write truncated the file would leave it out
    await download(cluster, "b")
    await downloaded(cluster, "b")
    assert hub.fetches(BIG) == [None, None], hub.fetches(BIG)  # a's, then b's whole file after a's bytes were thrown away
    same_files(b.home / "downloads" / FOLDER, checkpoint, all_files(checkpoint))
    assert re.search(rf"exo: peer a .* sent {BIG} with bytes that do not match", b.current_log()), b.current_log()[-3000:]


async def test_only_ring_members_may_list_or_read_and_only_verified_files(hub, checkpoint, tmp_path):
  async with a_holds_the_model(hub, tmp_path) as cluster:
    server = cluster.url("a")  # a node's files are on its API server
    folder = cluster.nodes["a"].home / "downloads" / FOLDER
    (folder / "half.safetensors.partial").write_bytes(b"x" * 100)
    (folder.parent / "secret.txt").write_text("not a model file")
    paths = ["/exo/files", f"/exo/files/{REPO}/{BIG}", f"/exo/files/{REPO}/nothing-here", "/exo/files/", "/exo/files/anything"]
    # A stranger: any address but the ring's (the nodes are at 127.0.0.1). The same 403 whatever it asks.
    stranger = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(connector=stranger) as session:
      for path in paths:
        async with session.get(URL(server + path, encoded=True)) as response:
          assert (response.status, await response.json()) == (403, {"error": "forbidden"}), path
    async with aiohttp.ClientSession() as session:  # from a member's address
      async with session.get(f"{server}/exo/files") as response:
        listing = await response.json()
        assert response.status == 200 and BIG in listing[REPO]["verified"], listing
      async with session.get(f"{server}/exo/files/{REPO}/{BIG}", headers={"Range": "bytes=10-"}) as response:
        assert response.status == 206 and await response.read() == (checkpoint / BIG).read_bytes()[10:]
      for path in [f"{REPO}/half.safetensors.partial", f"{REPO}/.exo-download.json", f"{REPO}/../secret.txt", f"{REPO}/%2E%2E/secret.txt",
                   "unsloth/..%2Fsecret.txt/x", f"{REPO}/nothing-here"]:
        async with session.get(URL(f"{server}/exo/files/{path}", encoded=True)) as response:
          assert response.status == 404 and b"not a model file" not in await response.read(), path

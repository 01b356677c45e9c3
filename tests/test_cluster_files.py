"""The parts of fetching from peers, on their own: the peer_files status as a peer's is checked, which peer a node
asks for a file (only holders of the same bytes, the cheapest first, different files from different peers, never
one that failed), which node fetches a file from the hub, the file list an offline node takes from its peers, and
which files a node's file server may hand out (only verified ones inside their download folder)."""
import asyncio
import json

import pytest

from exo.download import cluster_files
from exo.download.cluster_files import ClusterFiles
from exo.download.hub import HubFile
from exo.download.peer_files import caller_address, held_repos, verified_file
from exo.download.record import DownloadRecord
from exo.orchestration import statuses

pytestmark = pytest.mark.unit

REPO = "org/model"
WEIGHTS = HubFile("w.safetensors", 4, sha256="ab" * 32)
CONFIG = HubFile("config.json", 2, blob_id="cd" * 20)


def entry(file: HubFile) -> list:
  return [file.size, file.sha256, file.blob_id]


VERSIONS = iter(range(1, 1 << 30))


def announcement(node_id: str, verified=(), fetching=(), wants=False, offline=False, files=(WEIGHTS, CONFIG), port=5000, version=None) -> str:
  repo = {"commit": "c1", "files": {f.path: entry(f) for f in files}, "verified": list(verified), "fetching": list(fetching), "wants": wants}
  return statuses.PeerFiles.build(node_id=node_id, version=next(VERSIONS) if version is None else version, port=port, offline=offline, repos={REPO: repo})


class Peer:
  def __init__(self, node_id):
    self._id = node_id

  def id(self):
    return self._id


class FakeNode:
  """What ClusterFiles reads of a node: its peers and the addresses they are reached at; what it broadcasts."""

  def __init__(self, hosts):
    self.peer_hosts = hosts
    self.peers = [Peer(p) for p in hosts]
    self.sent = []

  def spawn(self, coro):
    return asyncio.ensure_future(coro)

  async def broadcast_opaque_status(self, request_id, status, to=None):
    self.sent.append((json.loads(status), to))


def cluster_of(hosts) -> ClusterFiles:
  cluster = ClusterFiles("me")
  cluster.node = FakeNode(hosts)
  return cluster


def hear(cluster: ClusterFiles, raw: str, host: str) -> None:
  kind, status = statuses.parse(raw)
  assert kind == statuses.PEER_FILES
  cluster._heard("", status, host)


def test_a_peer_files_status_is_checked_before_it_is_used():
  assert statuses.parse(announcement("a", verified=["w.safetensors"]))[0] == statuses.PEER_FILES
  good = json.loads(announcement("a"))
  bad = [
    {**good, "port": 0},
    {**good, "version": -1},
    {k: v for k, v in good.items() if k != "version"},
    {**good, "offline": "no"},
    {**good, "repos": {REPO: {**good["repos"][REPO], "verified": ["../../etc/passwd"]}}},  # not one of its files
    {**good, "repos": {REPO: {**good["repos"][REPO], "files": {"w": [4, "not hex!", None]}}}},
    {**good, "repos": {REPO: {**good["repos"][REPO], "files": {"w": [-1, None, None]}}}},
    {**good, "repos": {REPO: {**good["repos"][REPO], "wants": None}}},
    {**good, "repos": {f"r{i}": good["repos"][REPO] for i in range(statuses.MAX_REPOS + 1)}},
  ]
  for status in bad:
    with pytest.raises(statuses.InvalidStatus):
      statuses.parse(json.dumps(status))


def test_a_file_comes_from_holders_of_the_same_bytes_cheapest_first_spread_over_equals_and_never_from_one_that_failed():
  cluster = cluster_of({"near1": {"127.0.0.1"}, "near2": {"127.0.0.1"}, "far": {"10.9.8.7"}, "other": {"127.0.0.1"}})
  hear(cluster, announcement("near1", verified=["w.safetensors", "config.json"]), "127.0.0.1")
  hear(cluster, announcement("near2", verified=["w.safetensors", "config.json"]), "127.0.0.1")
  hear(cluster, announcement("far", verified=["w.safetensors"]), "10.9.8.7")
  changed = HubFile("w.safetensors", 4, sha256="ef" * 32)  # other bytes than the peers hold
  hear(cluster, announcement("other", verified=["w.safetensors"], files=(changed, CONFIG)), "127.0.0.1")
  sources = cluster.holders(REPO, WEIGHTS, set())
  assert [s.peer for s in sources][2:] == ["far"] and {s.peer for s in sources[:2]} == {"near1", "near2"}
  assert sources[0].url.endswith(f"/exo/files/{REPO}/w.safetensors") and sources[-1].url.startswith("http://10.9.8.7:5000/")
  assert cluster.holders(REPO, changed, set())[0].peer == "other"
  assert cluster.holders(REPO, HubFile("nobody.safetensors", 1), set()) == []
  spread = set()
  for i in range(16):
    name = f"shard-{i}.safetensors"
    file = HubFile(name, 1, sha256="00" * 32)
    for peer in ("near1", "near2"):
      hear(cluster, announcement(peer, verified=[name], files=(file,)), "127.0.0.1")
    spread.add(cluster.holders(REPO, file, set())[0].peer)
  assert spread == {"near1", "near2"}  # equals share the files
  hear(cluster, announcement("near1", verified=["w.safetensors"]), "127.0.0.1")
  hear(cluster, announcement("near2", verified=["w.safetensors"]), "127.0.0.1")
  assert [s.peer for s in cluster.holders(REPO, WEIGHTS, {"near1", "near2"})] == ["far"]


def test_only_a_member_speaks_for_itself_and_a_silent_or_departed_peer_stops_counting():
  cluster = cluster_of({"a": {"127.0.0.1"}})
  hear(cluster, announcement("a", verified=["w.safetensors"]), "10.0.0.66")  # not a's address
  hear(cluster, announcement("stranger", verified=["w.safetensors"]), "127.0.0.1")  # not a member
  assert cluster.holders(REPO, WEIGHTS, set()) == []
  hear(cluster, announcement("a", verified=["w.safetensors"]), "127.0.0.1")
  assert [s.peer for s in cluster.holders(REPO, WEIGHTS, set())] == ["a"]
  cluster.peers["a"].heard -= cluster_files.STALE_S + 1
  assert cluster.holders(REPO, WEIGHTS, set()) == []
  hear(cluster, announcement("a", verified=["w.safetensors"]), "127.0.0.1")
  cluster.node.peer_hosts = {}
  assert cluster.holders(REPO, WEIGHTS, set()) == []


def test_an_announcement_that_arrives_after_a_later_one_is_dropped():
  cluster = cluster_of({"a": {"127.0.0.1"}})
  hear(cluster, announcement("a", fetching=["w.safetensors"], version=20), "127.0.0.1")
  hear(cluster, announcement("a", version=10), "127.0.0.1")  # sent earlier, overtaken on the way
  assert cluster.hub_fetcher(REPO, "w.safetensors") == "a"
  hear(cluster, announcement("a", verified=["w.safetensors"], version=30), "127.0.0.1")
  assert cluster.hub_fetcher(REPO, "w.safetensors") is None and [s.peer for s in cluster.holders(REPO, WEIGHTS, set())] == ["a"]


def test_one_node_fetches_each_file_from_the_hub_and_every_node_agrees_which():
  names = ["a", "b", "c"]
  views = {}
  for me in names:
    cluster = ClusterFiles(me)
    cluster.node = FakeNode({p: {"127.0.0.1"} for p in names if p != me})
    for peer in names:
      if peer != me:
        hear(cluster, announcement(peer, wants=True), "127.0.0.1")
    views[me] = cluster
  paths = [f"model-{i}.safetensors" for i in range(12)]
  chosen = {me: [views[me].chosen_hub_fetcher(REPO, p) for p in paths] for me in names}
  assert chosen["a"] == chosen["b"] == chosen["c"] and set(chosen["a"]) == set(names)  # the same choice, spread over the nodes
  hear(views["a"], announcement("b", wants=True, offline=True), "127.0.0.1")
  assert "b" not in {views["a"].chosen_hub_fetcher(REPO, p) for p in paths}  # an offline node never fetches from the hub
  hear(views["a"], announcement("c", wants=True, fetching=["config.json"]), "127.0.0.1")
  assert views["a"].hub_fetcher(REPO, "config.json") == "c" and views["a"].hub_fetcher(REPO, "w.safetensors") is None
  # Two claimed one file at once: the lower id goes on, the other gives way to it.
  assert views["a"].rival_fetcher(REPO, "config.json") is None
  hear(views["c"], announcement("a", wants=True, fetching=["config.json"]), "127.0.0.1")
  assert views["c"].rival_fetcher(REPO, "config.json") == "a" and views["c"].rival_fetcher(REPO, "w.safetensors") is None


def test_a_node_that_cannot_ask_the_hub_lists_the_repository_as_the_peer_holding_most_of_it():
  cluster = cluster_of({"a": {"127.0.0.1"}, "b": {"127.0.0.1"}})
  assert cluster.listing(REPO) is None
  hear(cluster, announcement("a", verified=["config.json"]), "127.0.0.1")
  hear(cluster, announcement("b", verified=["config.json", "w.safetensors"]), "127.0.0.1")
  listing = cluster.listing(REPO)
  assert listing.commit == "c1" and listing.files == {"w.safetensors": WEIGHTS, "config.json": CONFIG}


def test_the_file_server_hands_out_only_verified_files_inside_their_folder(tmp_path, monkeypatch):
  monkeypatch.setenv("EXO_HOME", str(tmp_path))
  folder = tmp_path / "downloads" / "org--model"
  folder.mkdir(parents=True)
  (folder / "w.safetensors").write_bytes(b"abcd")
  (folder / "config.json").write_bytes(b"{}")
  (folder / "half.safetensors.partial").write_bytes(b"ab")
  (tmp_path / "secret").write_text("x")
  (folder / "link.json").symlink_to(tmp_path / "secret")
  files = {p: HubFile(p, n) for p, n in [("w.safetensors", 4), ("config.json", 2), ("half.safetensors", 4), ("link.json", 1), ("../../secret", 1)]}
  DownloadRecord(REPO, "c1", files, {"w.safetensors": 4, "config.json": 3, "link.json": 1, "../../secret": 1}).save(folder)
  assert verified_file(REPO, "w.safetensors") == (folder / "w.safetensors").resolve()
  assert verified_file(REPO, "config.json") is None  # not the size it was verified at
  assert verified_file(REPO, "half.safetensors") is None and verified_file(REPO, "half.safetensors.partial") is None
  assert verified_file(REPO, "link.json") is None and verified_file(REPO, "../../secret") is None  # outside the folder
  assert verified_file(REPO, ".exo-download.json") is None
  assert verified_file("org/../downloads", "w.safetensors") is None and verified_file("org", "w.safetensors") is None
  assert {r: sorted(record.verified) for r, record in held_repos().items()} == {REPO: ["w.safetensors"]}
  DownloadRecord("someone/else", "c1", files, {"w.safetensors": 4}).save(tmp_path / "downloads" / "elsewhere")
  assert set(held_repos()) == {REPO}  # a record not in its repository's own folder is not served


async def test_announcements_say_what_is_held_wanted_and_fetched_while_it_is(monkeypatch, tmp_path):
  monkeypatch.setenv("EXO_HOME", str(tmp_path))
  folder = tmp_path / "downloads" / "org--model"
  folder.mkdir(parents=True)
  (folder / "config.json").write_bytes(b"{}")
  DownloadRecord(REPO, "c1", {"config.json": CONFIG, "w.safetensors": WEIGHTS}, {"config.json": 2}).save(folder)
  cluster = ClusterFiles("me")
  cluster.node, cluster.port = FakeNode({"a": {"127.0.0.1"}}), 52415
  await cluster.announce()
  (status, to), = cluster.node.sent
  assert statuses.parse(json.dumps(status))[0] == statuses.PEER_FILES and to == {"a"}
  assert (status["node_id"], status["port"], status["offline"]) == ("me", 52415, False) and status["version"] > 0
  assert status["repos"][REPO] == {"commit": "c1", "files": {"config.json": entry(CONFIG), "w.safetensors": entry(WEIGHTS)}, "verified": ["config.json"],
                                   "fetching": [], "wants": False}
  with cluster.wanting(REPO), cluster.fetching_from_hub(REPO, "w.safetensors"):
    await cluster.announce()
    assert cluster.node.sent[-1][0]["repos"][REPO]["fetching"] == ["w.safetensors"] and cluster.node.sent[-1][0]["repos"][REPO]["wants"]
  await cluster.announce()
  assert cluster.node.sent[-1][0]["repos"][REPO]["fetching"] == [] and not cluster.node.sent[-1][0]["repos"][REPO]["wants"]


def test_a_caller_is_known_by_the_address_members_are_known_by():
  assert caller_address("::ffff:10.0.0.2") == "10.0.0.2"  # IPv4 through an IPv6 socket
  assert caller_address("10.0.0.2") == "10.0.0.2" and caller_address("fe80::1%eth0") == "fe80::1"
  assert caller_address(None) is None and caller_address("unix socket") is None


async def test_a_node_asks_for_files_only_once_every_peer_has_announced_its_own_or_stayed_silent_too_long(monkeypatch):
  now = [1000.0]
  monkeypatch.setattr(cluster_files.time, "monotonic", lambda: now[0])  # a clock the test moves
  cluster = cluster_of({"a": {"127.0.0.1"}, "upstream": {"127.0.0.1"}})
  assert cluster.unheard_for() == cluster_files.FIRST_WORD_S  # neither has spoken: wait for both
  hear(cluster, announcement("a", verified=["w.safetensors"]), "127.0.0.1")
  now[0] += 1.0
  assert cluster.unheard_for() == cluster_files.FIRST_WORD_S - 1.0  # "upstream" has not spoken yet
  now[0] += cluster_files.FIRST_WORD_S
  assert cluster.unheard_for() == 0.0  # silent too long: not waited for (an upstream node never speaks)
  await asyncio.wait_for(cluster.heard_every_peer(), 5)
  assert [s.peer for s in cluster.holders(REPO, WEIGHTS, set())] == ["a"]

"""The parts of a download, on their own: progress counted as bytes arrive (with a driven clock), the record of what
is verified on disk, which files a shard needs, hashes as the hub announces them, a failure's message as it
crosses the ring, and the TUI's rendering of a download."""
import hashlib
import json

import pytest
from rich.console import Console

from exo.download.download_progress import RepoProgressEvent, DownloadProgress
from exo.download.errors import KINDS, DownloadError, DownloadFailure
from exo.download.hub import FileHash, HubFile, RepoListing
from exo.download.record import DownloadRecord
from exo.download.shard_files import needed_files
from exo.inference.shard import Shard
from exo.orchestration import statuses
from exo.topology.topology import Topology
from exo.viz.topology_viz import TopologyViz, download_summary

pytestmark = pytest.mark.unit

SHARD = Shard("llama-3.2-1b", 0, 7, 16)
# upstream's wire format: exactly these keys (an upstream node rebuilds its dataclasses from them)
EVENT_KEYS = {"shard", "repo_id", "repo_revision", "completed_files", "total_files", "downloaded_bytes", "downloaded_bytes_this_session",
              "total_bytes", "overall_speed", "overall_eta", "file_progress", "status"}
FILE_KEYS = {"repo_id", "repo_revision", "file_path", "downloaded", "downloaded_this_session", "total", "speed", "eta", "status", "start_time"}


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now


def test_progress_counts_bytes_as_they_arrive_with_speed_and_time_left():
  clock = Clock()
  progress = DownloadProgress(SHARD, "org/repo", "main", {"a.safetensors": 1000, "config.json": 10}, {"a.safetensors": 200, "config.json": 10},
                              clock=clock, wall_clock=lambda: 1.7e9)
  first = progress.event("in_progress")
  assert (first.downloaded_bytes, first.total_bytes, first.completed_files, first.total_files) == (210, 1010, 1, 2)
  assert first.overall_speed == 0 and first.file_progress["a.safetensors"].status == "not_started"
  clock.now += 1
  progress.add("a.safetensors", 300)
  event = progress.event("in_progress")
  assert event.downloaded_bytes == 510 and event.downloaded_bytes_this_session == 300 and event.overall_speed == pytest.approx(300)
  assert event.overall_eta == pytest.approx(500 / 300)
  a = event.file_progress["a.safetensors"]
  assert (a.downloaded, a.downloaded_this_session, a.status, a.start_time) == (500, 300, "in_progress", 1.7e9) and a.eta == pytest.approx(500 / 300)
  assert set(event.to_dict()) == EVENT_KEYS and set(event.to_dict()["file_progress"]["a.safetensors"]) == FILE_KEYS
  assert RepoProgressEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event  # what a ring peer rebuilds
  for _ in range(10):  # a stall: the speed falls to nothing within the window, not averaged over the whole download
    clock.now += 1
    stalled = progress.event("in_progress")
  assert stalled.overall_speed == 0 and stalled.overall_eta == 0
  progress.add("a.safetensors", -500)  # the hub ignored a Range: the file starts again
  assert progress.event("in_progress").file_progress["a.safetensors"].downloaded == 0
  progress.add("a.safetensors", 1000)
  progress.finish("a.safetensors")
  done = progress.event("complete")
  assert (done.downloaded_bytes, done.completed_files, done.file_progress["a.safetensors"].status) == (1010, 2, "complete")


def test_the_record_keeps_only_what_is_verified_on_disk_and_still_announced(tmp_path):
  files = {"a": HubFile("a", 3, sha256="00" * 32), "b": HubFile("b", 2, blob_id="11" * 20)}
  record = DownloadRecord("org/repo", "c1", files, {"a": 3, "b": 2})
  (tmp_path / "a").write_bytes(b"abc")
  (tmp_path / "b.partial").write_bytes(b"x")
  assert record.missing(tmp_path, ["a", "b"]) == ["b"]  # b was deleted since
  assert record.bytes_on_disk(tmp_path, "a") == 3 and record.bytes_on_disk(tmp_path, "b") == 1
  (tmp_path / "a").write_bytes(b"abcd")  # changed on disk: no longer the verified file
  assert record.missing(tmp_path, ["a"]) == ["a"]
  record.save(tmp_path)
  assert DownloadRecord.load(tmp_path) == record
  relisted = record.relisted(RepoListing("c2", {"a": files["a"], "b": HubFile("b", 2, blob_id="22" * 20)}))
  assert relisted.commit == "c2" and relisted.verified == {"a": 3}  # b changed on the hub: fetched again
  (tmp_path / ".exo-download.json").write_text("{not json")
  assert DownloadRecord.load(tmp_path) is None  # unreadable: nothing counts as verified


def test_a_shard_needs_its_layers_files_and_the_shared_ones():
  weight_map = {"model.layers.0.w": "one.safetensors", "model.layers.9.w": "two.safetensors", "model.embed_tokens.weight": "shared.safetensors"}
  repo = ["config.json", "tokenizer.json", "model.safetensors.index.json", "one.safetensors", "two.safetensors", "shared.safetensors", "README.md"]
  assert needed_files(repo, SHARD, weight_map) == ["config.json", "model.safetensors.index.json", "one.safetensors", "shared.safetensors", "tokenizer.json"]
  with pytest.raises(DownloadFailure, match=r"no two.safetensors \(model.safetensors.index.json names them\)") as missing:
    needed_files([f for f in repo if f != "two.safetensors"], Shard("llama-3.2-1b", 8, 15, 16), weight_map)
  assert missing.value.kind == "file_not_found"
  with pytest.raises(DownloadFailure, match="no tokenizer.json"):
    needed_files([f for f in repo if f != "tokenizer.json"], SHARD, weight_map)
  with pytest.raises(DownloadFailure, match="the weights"):
    needed_files(["config.json", "tokenizer.json"], SHARD, None)


def test_hashes_are_the_ones_the_hub_announces():
  data = b"hello\n"
  git = FileHash(HubFile("x", len(data), blob_id="ce013625030ba8dba906f756967f9e9ca394464a"))  # `git hash-object` of it
  git.update(data)
  assert git.mismatch() is None
  lfs = FileHash(HubFile("y", len(data), sha256=hashlib.sha256(data).hexdigest()))
  lfs.update(b"hellO\n")
  assert "y hashes to" in lfs.mismatch()


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_download_error_keeps_its_kind_across_the_ring(kind):
  error = DownloadError("llama-3.2-1b", "org/repo", kind, "what happened:\n  in detail", "http://127.0.0.1:9", "node-b")
  assert "\n" not in error.message and error.status in (502, 503, 504, 507)
  again = DownloadError.from_message(error.message)  # a request_error carries the message only
  assert (again.model_id, again.repo_id, again.kind, again.endpoint, again.node_id, again.detail) == \
         ("llama-3.2-1b", "org/repo", kind, "http://127.0.0.1:9", "node-b", "what happened: in detail")
  assert DownloadError.from_message(f"node x failed: {error.message}") is None  # only a download error's own text


def test_download_progress_may_say_where_each_file_comes_from():
  status = {"type": "download_progress", "node_id": "a", "progress": {}}
  assert statuses.parse(json.dumps({**status, "sources": {"w.safetensors": "peer b", "config.json": "hub"}}))[0] == "download_progress"
  assert statuses.parse(json.dumps(status))[0] == "download_progress"  # an upstream node's: none
  for sources in ({"w": 3}, ["hub"], {"w": "x" * 1000}):
    with pytest.raises(statuses.InvalidStatus):
      statuses.parse(json.dumps({**status, "sources": sources}))


def test_the_tui_shows_a_download_file_by_file():
  viz = TopologyViz()
  viz.update_visualization(Topology(), [], "node-b")
  viz.update_status({"type": "download_progress", "node_id": "stranger", "progress": {}})  # not of this ring: ignored
  progress = DownloadProgress(SHARD, "org/repo", "main", {"big.safetensors": 4 << 20, "config.json": 100}, {"config.json": 100}, clock=Clock())
  progress.add("big.safetensors", 1 << 20)
  event = progress.event("in_progress").to_dict()
  viz.update_status({"type": "download_progress", "node_id": "node-b", "progress": event, "sources": {"big.safetensors": "peer node-a"}})
  console = Console(record=True, width=160)
  console.print(viz.render())
  screen = console.export_text()
  assert "Downloads" in screen and "org/repo" in screen and "big.safetensors from peer node-a" in screen and "25% · 1.00 MB / 4.00 MB" in screen
  assert download_summary(RepoProgressEvent.from_dict({**event, "status": "not_started"})) == "stopped at 25%"
  assert download_summary(RepoProgressEvent.from_dict({**event, "status": "complete"})) == "done"

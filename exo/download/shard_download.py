"""Getting a shard's files onto this node: the downloader interface, the no-op one the dummy engine uses, and
HFShardDownloader, which fetches from the Hugging Face Hub (or the mirror HF_ENDPOINT names) into
$EXO_HOME/downloads/<org>--<repo>.

HFShardDownloader runs one download per model at a time: a request that needs a model while its download runs waits
for that download (and may stop waiting, when its client leaves, without stopping it). A download lists the
repository, fetches the weight index and the config first, then the files the shard's layers need, several at
once, each resumed from whatever an earlier attempt left (hub.py), while its progress goes to `on_progress` every
PROGRESS_INTERVAL_S. Nothing is remembered between attempts but what the folder's record says is verified on disk
(record.py): a failure ends the waiting requests with a DownloadError and the next request starts afresh."""
import asyncio
import logging
import shutil
import time
from abc import ABC, abstractmethod
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Dict, List, Optional, Set, Tuple

import aiohttp

from exo.download import cluster_files, hub
from exo.download.cluster_files import ClusterFiles
from exo.download.download_progress import DownloadProgress, RepoProgressEvent
from exo.download.errors import DownloadError, DownloadFailure
from exo.download.hub import HubFile
from exo.download.record import DownloadRecord
from exo.download.shard_files import INDEX, has_shard_files, local_model_path, matching_files, needed_files, read_weight_map, repo_dir
from exo.download.shard_files import embedded_model_path  # noqa: F401 (imported from here by the tests and benches)
from exo.helpers import AsyncCallbackSystem
from exo.inference.shard import Shard
from exo.models import get_repo

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5


class ShardDownloader(ABC):
  @abstractmethod
  async def ensure_shard(self, shard: Shard, inference_engine_name: str) -> Path:
    """Make the shard's files present locally; return the model path (directory or .gguf file)."""

  @property
  @abstractmethod
  def on_progress(self) -> AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]:
    ...

  @abstractmethod
  async def get_shard_download_status(self, inference_engine_name: str) -> AsyncIterator[Tuple[Path, RepoProgressEvent]]:
    ...

  def is_downloading(self, repo_id: str) -> bool:
    """Whether a download of the repository is under way here (its files must not be deleted meanwhile)."""
    return False

  async def ensure_repo(self, repo_id: str, shard: Shard) -> Path:
    """A repository's files for `shard`, for a model outside the chat registry; a downloader that fetches nothing
    (the dummy engine's) says so."""
    raise DownloadError(shard.model_id, repo_id, "offline", "this node downloads no models (its engine needs none)")

  def arriving_from(self, model_id: str) -> Dict[str, str]:
    """The model's files arriving now, each with where from: "hub" or "peer <node id>"."""
    return {}


class NoopShardDownloader(ShardDownloader):
  def __init__(self):
    self._on_progress = AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]()

  async def ensure_shard(self, shard: Shard, inference_engine_name: str) -> Path:
    return Path("/tmp/noop_shard")

  @property
  def on_progress(self) -> AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]:
    return self._on_progress

  async def get_shard_download_status(self, inference_engine_name: str) -> AsyncIterator[Tuple[Path, RepoProgressEvent]]:
    if False:
      yield


class _GiveWay(Exception):
  """Another node fetches the same file from the hub: this one stops (its partial file stays) and fetches the rest
  from that node. args[0]: the other node's id."""


def _give_way_to(rival: Optional[str]) -> None:
  if rival is not None:
    raise _GiveWay(rival)


@dataclass
class _Download:
  """A download under way: the shard it is for, its task, and its progress once the file list is known."""
  shard: Shard
  task: asyncio.Task
  progress: Optional[DownloadProgress] = None


class HFShardDownloader(ShardDownloader):
  """Downloads through the hub into $EXO_HOME/downloads/<org>--<repo>, reporting progress per shard. `node_id` names
  this node in error messages (a ring's requests fail with the error of whichever node it happened on)."""

  def __init__(self, max_parallel_downloads: int = 8, node_id: Optional[str] = None, cluster: Optional[ClusterFiles] = None):
    self.max_parallel_downloads = max_parallel_downloads
    self.node_id = node_id
    self.cluster = cluster or ClusterFiles(node_id or "")  # unattached: no peers, every file from the hub
    self._on_progress = AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]()
    self._running: Dict[str, _Download] = {}  # repo id -> its download
    self._outcomes: Dict[str, dict] = {}  # model id -> how its latest download went (see `downloads`)

  @property
  def on_progress(self) -> AsyncCallbackSystem[str, Tuple[Shard, RepoProgressEvent]]:
    return self._on_progress

  def is_downloading(self, repo_id: str) -> bool:
    return repo_id in self._running

  async def ensure_shard(self, shard: Shard, inference_engine_name: str) -> Path:
    repo_id = get_repo(shard.model_id, inference_engine_name)
    if repo_id is None:
      raise ValueError(f"Model {shard.model_id} has no repo for {inference_engine_name}")
    return await self.ensure_repo(repo_id, shard)

  async def ensure_repo(self, repo_id: str, shard: Shard) -> Path:
    """The repository's files that `shard` needs, as ensure_shard, for a model named by its repository: an embedding
    model, which the chat registry does not list (shard.model_id names it in progress and errors)."""
    local = local_model_path(repo_id)
    if local is not None:
      return local
    while True:
      download = self._running.get(repo_id) or self._start(repo_id, shard)
      if download.shard == shard:
        return await asyncio.shield(download.task)  # a waiter that leaves does not stop the download
      await asyncio.wait([download.task])  # one download per model: another shard's first (what it fetches counts for ours)

  def _start(self, repo_id: str, shard: Shard) -> _Download:
    download = _Download(shard, asyncio.ensure_future(self._download(repo_id, shard)))
    self._running[repo_id] = download
    download.task.add_done_callback(lambda task: self._running.pop(repo_id) if self._running.get(repo_id) is download else None)
    download.task.add_done_callback(lambda task: task.cancelled() or task.exception())  # its waiters may all have left
    return download

  async def _download(self, repo_id: str, shard: Shard) -> Path:
    folder = repo_dir(repo_id)
    self._outcomes[shard.model_id] = {"repo_id": repo_id, "status": "in_progress", "error": None}
    try:
      async with _folder_lock(folder):
        if not _complete_on_disk(folder, shard):
          await self._fetch_shard(repo_id, shard, folder)
    except Exception as e:
      error = DownloadError.of(e, shard.model_id, repo_id, hub.endpoint(), self.node_id) if isinstance(e, DownloadFailure) else e
      self._outcomes[shard.model_id].update(status="failed", error={"message": str(error) or repr(error), "code": getattr(error, "kind", "download_failed"),
                                                                    "status": getattr(error, "status", 500)})
      progress = self._running[repo_id].progress
      if progress is not None:  # ring peers stop showing it as under way (upstream nodes list only in_progress ones)
        self._on_progress.trigger_all(shard, progress.event("not_started"))
      log.error("exo: %r" if error is e else "exo: %s", error)  # the node's operator hears of it too
      raise error from None
    self._outcomes[shard.model_id]["status"] = "complete"
    return folder

  async def _fetch_shard(self, repo_id: str, shard: Shard, folder: Path) -> None:
    with self.cluster.wanting(repo_id):
      listing, use_hub = await self._listing(repo_id, folder, shard)
      record = (DownloadRecord.load(folder) or DownloadRecord(repo_id, listing.commit, {})).relisted(listing)
      record.save(folder)
      sources: Dict[str, hub.Source] = {}  # path -> where its bytes come from
      async with aiohttp.ClientSession(trust_env=True) as session:
        if INDEX in listing.files:  # which weight files hold the shard's layers
          await self._fetch(session, record, folder, INDEX, None, use_hub, sources)
        needed = needed_files(listing.files, shard, read_weight_map(folder) if INDEX in listing.files else None)
        missing = record.missing(folder, needed)
        _check_space(folder, record, missing)
        progress = DownloadProgress(shard, repo_id, hub.REVISION, {p: listing.files[p].size for p in needed},
                                    {p: record.bytes_on_disk(folder, p) for p in needed})
        progress.sources = sources
        self._running[repo_id].progress = progress
        reporter = asyncio.ensure_future(self._report(shard, progress))
        try:
          await _all_or_none([self._fetch(session, record, folder, path, progress, use_hub, sources) for path in missing], self.max_parallel_downloads)
        finally:
          reporter.cancel()
    self._outcomes[shard.model_id]["progress"] = progress.event("complete").to_dict()
    self._outcomes[shard.model_id]["files"] = _files_view(progress, progress.event("complete"))
    self._on_progress.trigger_all(shard, progress.event("complete"))

  async def _listing(self, repo_id: str, folder: Path, shard: Shard) -> Tuple[hub.RepoListing, bool]:
    """(the repository's file list, whether the hub may be asked for files): the hub's, or, offline or when the hub
    does not answer, that of a peer that holds the repository."""
    if hub.offline():
      listing = await self._peer_listing(repo_id)
      if listing is None:
        raise DownloadFailure("offline", _offline_detail(folder, shard))
      log.info("exo: HF_HUB_OFFLINE=1: fetching %s from peers", repo_id)
      return listing, False
    try:
      return await hub.list_repo(repo_id), True
    except DownloadFailure as e:
      if e.kind not in ("hub_unreachable", "hub_timeout"):
        raise
      listing = await self._peer_listing(repo_id)
      if listing is None:
        raise
      log.warning("exo: %s; fetching %s from peers", e, repo_id)
      return listing, False

  async def _peer_listing(self, repo_id: str) -> Optional[hub.RepoListing]:
    await self.cluster.heard_every_peer()  # a node just started may not have heard its peers yet
    return self.cluster.listing(repo_id)

  async def _fetch(self, session: aiohttp.ClientSession, record: DownloadRecord, folder: Path, path: str, progress: Optional[DownloadProgress],
                   use_hub: bool, sources: Dict[str, hub.Source]) -> None:
    """One file made verified: one already in place (an older exo, or a node killed before it noted it) is checked,
    anything else fetched."""
    file, final = record.files[path], folder / path
    if record.is_verified(folder, path):
      return
    if not (final.exists() and await asyncio.to_thread(hub.file_matches, final, file)):
      final.unlink(missing_ok=True)
      await self._obtain(session, record, folder, file, progress, use_hub, sources)
    record.verified[path] = file.size
    record.save(folder)
    self.cluster.announce_now()  # peers waiting for it may fetch it from here now
    if progress is not None:
      progress.finish(path)

  async def _obtain(self, session: aiohttp.ClientSession, record: DownloadRecord, folder: Path, file: HubFile, progress: Optional[DownloadProgress],
                    use_hub: bool, sources: Dict[str, hub.Source]) -> None:
    """The file's bytes from the cheapest peer holding it verified, else from the hub, as cluster_files.py lays out."""
    cluster, repo_id, path = self.cluster, record.repo_id, file.path
    on_bytes = (lambda n: progress.add(path, n)) if progress else (lambda n: None)
    failed: Set[str] = set()  # peers that failed this file
    waiting_since: Optional[float] = None
    await cluster.heard_every_peer()
    while True:
      for source in cluster.holders(repo_id, file, failed):
        sources[path] = source
        try:
          started, before = time.monotonic(), record.bytes_on_disk(folder, path)
          await hub.fetch_file(session, source, repo_id, record.commit, file, folder, on_bytes)
          seconds = max(time.monotonic() - started, 1e-6)
          log.info("exo: %s from %s: %.1f MB in %.2f s (%.0f MB/s)", path, source.name, (file.size - before) / 1e6, seconds, (file.size - before) / 1e6 / seconds)
          return
        except DownloadFailure as e:
          if e.kind == "disk_full":
            raise
          failed.add(source.peer)
          if e.kind == "corrupt":
            log.warning("exo: %s sent %s with bytes that do not match (%s); discarded them, fetching it elsewhere", source.name, path, e.detail)
          else:
            log.warning("exo: %s failed to send %s (%s); fetching the rest elsewhere", source.name, path, e.detail)
      if use_hub:
        fetcher = cluster.hub_fetcher(repo_id, path)
        chosen = cluster.chosen_hub_fetcher(repo_id, path)
        waiting_since = waiting_since or time.monotonic()
        if (fetcher is not None and fetcher not in failed) or (
            chosen != self.node_id and chosen not in failed and time.monotonic() - waiting_since < cluster_files.HUB_GRACE_S):
          await cluster.changed(cluster_files.ANNOUNCE_INTERVAL_S)  # until it holds the file (or gives up)
          continue
        source = hub.hub_source(repo_id, record.commit, path)
        sources[path] = source

        def on_hub_bytes(n: int) -> None:
          on_bytes(n)
          _give_way_to(cluster.rival_fetcher(repo_id, path, failed))
        try:
          with cluster.fetching_from_hub(repo_id, path):
            await self._claim(repo_id, file, failed)
            await hub.fetch_file(session, source, repo_id, record.commit, file, folder, on_hub_bytes)
          return
        except _GiveWay as e:
          log.info("exo: peer %s fetches or holds %s too; this node takes it from there", e.args[0], path)
          continue
      if cluster.may_bring(repo_id) or cluster.hub_fetcher(repo_id, path) is not None:
        await cluster.changed(cluster_files.ANNOUNCE_INTERVAL_S)
        continue
      why = "HF_HUB_OFFLINE=1" if hub.offline() else f"{hub.endpoint()} did not answer"
      tried = f" ({', '.join(sorted(failed))} failed to send it)" if failed else ""
      raise DownloadFailure("offline" if hub.offline() else "hub_unreachable", f"{why}, and no peer holds {path} verified{tried}")

  async def _claim(self, repo_id: str, file: HubFile, failed: Set[str]) -> None:
    """Before a hub fetch: the claim is announced (fetching_from_hub); CLAIM_S later, unless a node with a lower id
    claimed the file too, or a peer holds it by then (then _GiveWay), it is this node's. Nodes that chose the same
    file at once, before they heard of each other, settle who fetches it before any byte comes twice."""
    if not self.cluster.has_peers():
      return

    def give_way_if_another_has_it() -> None:
      holders = self.cluster.holders(repo_id, file, failed)
      _give_way_to(self.cluster.rival_fetcher(repo_id, file.path, failed) or (holders[0].peer if holders else None))
    deadline = time.monotonic() + cluster_files.CLAIM_S
    while (left := deadline - time.monotonic()) > 0:
      give_way_if_another_has_it()
      await self.cluster.changed(left)
    give_way_if_another_has_it()

  async def _report(self, shard: Shard, progress: DownloadProgress) -> None:
    """The progress at a steady rate while bytes arrive (never one event per chunk)."""
    while True:
      event = progress.event("in_progress")
      self._outcomes[shard.model_id]["progress"] = event.to_dict()
      self._outcomes[shard.model_id]["files"] = _files_view(progress, event)
      self._on_progress.trigger_all(shard, event)
      await asyncio.sleep(PROGRESS_INTERVAL_S)

  def arriving_from(self, model_id: str) -> Dict[str, str]:
    files = self._outcomes.get(model_id, {}).get("files") or {}
    return {path: "hub" if f["source"] == "hub" else f"peer {f['peer']}" for path, f in files.items() if f["source"] and f["status"] == "in_progress"}

  def downloads(self) -> Dict[str, dict]:
    """This node's downloads since it started, by model: status (in_progress, complete, failed), repository, the
    error when it failed (message, code, HTTP status), and the latest progress."""
    return {model: dict(outcome) for model, outcome in self._outcomes.items()}

  async def get_shard_download_status(self, inference_engine_name: str) -> AsyncIterator[Tuple[Path, RepoProgressEvent]]:
    """For each model this engine can run: how much of its full shard is on disk, from the files alone (no hub)."""
    from exo.models import build_full_shard, model_cards
    for model_id in list(model_cards):  # local checkpoints may join the registry while this runs
      shard = build_full_shard(model_id, inference_engine_name)
      repo_id = get_repo(model_id, inference_engine_name)
      if shard is None or repo_id is None:
        continue
      local = local_model_path(repo_id)
      if local is not None:
        size = local.stat().st_size if local.is_file() else sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
        yield local, RepoProgressEvent(shard, repo_id, hub.REVISION, 1, 1, size, 0, size, 0.0, 0.0, {}, "complete")
        continue
      folder = repo_dir(repo_id)
      yield folder, await asyncio.to_thread(_status_on_disk, folder, shard, repo_id, self.is_downloading(repo_id))


@asynccontextmanager
async def _folder_lock(folder: Path):
  """One process at a time downloads into a folder (nodes on one machine may share an EXO_HOME): the others wait."""
  try:
    import fcntl
  except ImportError:  # Windows
    yield
    return
  folder.mkdir(parents=True, exist_ok=True)
  with open(folder / ".exo-download.lock", "w") as handle:
    while True:
      try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except BlockingIOError:
        await asyncio.sleep(0.2)  # polled, so that a waiter can be cancelled
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


async def _all_or_none(jobs: List, limit: int) -> None:
  """Run the coroutines, `limit` at a time; the first failure cancels the rest and is raised."""
  slots = asyncio.Semaphore(limit)

  async def run(job):
    async with slots:
      await job
  tasks = [asyncio.ensure_future(run(job)) for job in jobs]
  try:
    await asyncio.gather(*tasks)
  finally:
    for task in tasks:
      task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _files_view(progress: DownloadProgress, event: RepoProgressEvent) -> Dict[str, dict]:
  """Each file of a download with where its bytes come from (`source`: peer or hub, and which), its speed and status."""
  view = {}
  for path, file in event.file_progress.items():
    source = progress.sources.get(path)
    view[path] = {"source": None if source is None else "hub" if source.peer is None else "peer", "peer": source and source.peer,
                  "from": source and source.name, "speed": file.speed, "downloaded": file.downloaded, "total": file.total, "status": file.status}
  return view


def downloaded_path(repo_id: str, shard: Shard) -> Optional[Path]:
  """The repository's folder under $EXO_HOME/downloads when every file the shard needs is there, else None."""
  folder = repo_dir(repo_id)
  return folder if folder.is_dir() and _complete_on_disk(folder, shard) else None


def _complete_on_disk(folder: Path, shard: Shard) -> bool:
  """Whether the shard's files are all here: verified ones (see record.py), or, in a folder exo did not download
  (copied there by hand, or left by an older exo), every file it needs."""
  record = DownloadRecord.load(folder)
  if record is None:
    return has_shard_files(folder, shard)
  if INDEX in record.files and not record.is_verified(folder, INDEX):
    return False
  try:
    return not record.missing(folder, needed_files(record.files, shard, read_weight_map(folder) if INDEX in record.files else None))
  except DownloadFailure:
    return False


def _check_space(folder: Path, record: DownloadRecord, missing: List[str]) -> None:
  needed = sum(record.files[p].size - record.bytes_on_disk(folder, p) for p in missing)
  free = shutil.disk_usage(folder).free
  if needed > free:
    raise DownloadFailure("disk_full", f"the files still to fetch take {needed:,} bytes; the disk of {folder} has {free:,} free")


def _offline_detail(folder: Path, shard: Shard) -> str:
  record = DownloadRecord.load(folder)
  if record is None:
    return f"HF_HUB_OFFLINE=1 and {folder} holds no complete download of it; fetch it once with the hub reachable, or put its files there"
  try:
    needed = needed_files(record.files, shard, read_weight_map(folder) if record.is_verified(folder, INDEX) else None)
  except DownloadFailure as e:
    return f"HF_HUB_OFFLINE=1 and its download in {folder} cannot complete: {e.detail}"
  missing = record.missing(folder, needed)
  return (f"HF_HUB_OFFLINE=1 and {len(missing)} of the {len(needed)} files it needs are not complete in {folder} "
          f"({', '.join(missing[:3])}{', …' if len(missing) > 3 else ''}); fetch them with the hub reachable")


def _status_on_disk(folder: Path, shard: Shard, repo_id: str, downloading: bool) -> RepoProgressEvent:
  """The shard's files on disk as a progress event: complete only if every one is verified (or, in a folder exo did
  not download, present)."""
  record = DownloadRecord.load(folder)
  status = "complete" if _complete_on_disk(folder, shard) else "in_progress" if downloading else "not_started"
  if record is None:
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if status == "complete" else 0
    return RepoProgressEvent(shard, repo_id, hub.REVISION, int(status == "complete"), 1, size, 0, size, 0.0, 0.0, {}, status)
  paths = matching_files(record.files, shard, None)  # a full shard needs every weight file
  on_disk = sum(record.bytes_on_disk(folder, p) for p in paths)
  return RepoProgressEvent(shard, repo_id, hub.REVISION, sum(record.is_verified(folder, p) for p in paths), len(paths), on_disk, 0,
                           sum(record.files[p].size for p in paths), 0.0, 0.0, {}, status)

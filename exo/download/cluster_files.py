"""What the cluster holds of each model, and who fetches what from whom, so that a model crosses the internet once.

Every node announces, in a `peer_files` status (statuses.py; nodes that do not know the type ignore it), the files
it holds verified (with the size and hash its record has for them), the repositories it is downloading, the files
it is fetching from the hub right now, and the port of its API server, which serves them (peer_files.py). It announces when any of
that changes and every ANNOUNCE_INTERVAL_S besides (a peer may have missed one).

A node that needs a file (shard_download.py, `_obtain`) first waits until every peer has announced (a node that
just joined would otherwise take from the hub what a peer holds; a peer silent for FIRST_WORD_S, as an upstream node
is, is not waited for), then:
1. fetches it from a peer that holds it verified with the same hash, the cheapest first (same machine, then the
   rest; among equals spread by file, so different files come from different peers);
2. else, if a peer is fetching it from the hub now, waits for that peer to hold it and fetches it from the peer;
3. else, of the nodes downloading the repository now that can reach the hub, one is its hub fetcher (the same choice
   on every node, spread by file); if that is this node, or the chosen one has not started within HUB_GRACE_S, this
   node claims it (announces it as fetching) and, CLAIM_S later, fetches it from the hub, unless a node with a lower
   id claimed it too: then it gives way and waits for that node, as in 2. (Nodes asked at once may choose before they
   hear of each other; the claim settles it before bytes come twice, and a node still fetching when it hears of a
   lower id's claim stops, keeping its partial file for the rest from that node.)
The others fetch a file once its hub fetcher holds it whole, not as its bytes arrive: a peer serves only verified
files (a file whose bytes turn out wrong never spreads), and on a LAN a peer sends a file far faster than the hub
sent it, so what this costs is one LAN transfer of the last file.

A peer that fails a transfer, or sends bytes that do not match, is not asked for that file again by this download;
the file resumes from the next peer or the hub. A node offline (HF_HUB_OFFLINE=1) or unable to reach the hub takes
the repository's file list from a peer that holds it, and checks what it fetches against that peer's hashes."""
import asyncio
import hashlib
import ipaddress
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Set, Tuple

from exo.download import hub
from exo.download.hub import HubFile, RepoListing, Source
from exo.download.peer_files import FILES_PREFIX, PeerFileRoutes, held_repos
from exo.orchestration import statuses

log = logging.getLogger(__name__)

ANNOUNCE_INTERVAL_S = 2.0
STALE_S = 15.0  # a peer's announcement not renewed for this long no longer counts
CLAIM_S = 0.5  # a hub fetch starts this long after it is announced, so that nodes that chose one file at once find out first
HUB_GRACE_S = 5.0  # how long a node waits for the hub fetcher chosen for a file to start it
FIRST_WORD_S = 2 * ANNOUNCE_INTERVAL_S  # how long a new peer may take to announce its files (an upstream node never does)
PEER_ATTEMPTS = 2  # a peer that brings nothing twice in a row has failed
ANNOUNCED_REPOS = 64  # at most this many repositories in one announcement (each lists its files)


@dataclass
class PeerHoldings:
  node_id: str
  version: int
  port: int
  offline: bool
  repos: Dict[str, statuses.RepoHoldings]
  heard: float  # monotonic time


def _spread(key: str, choices: List[str]) -> str:
  """One of `choices`, the same on every node for the same key and choices."""
  return choices[int(hashlib.sha256(key.encode()).hexdigest(), 16) % len(choices)]


_NOTHING_HELD = statuses.RepoHoldings(commit="-", files={}, verified=[], fetching=[], wants=False)


def _file_entry(file: HubFile) -> tuple:
  return (file.size, file.sha256, file.blob_id)


class ClusterFiles:
  """This node's side of the cluster's files: its file server, its announcements, and the peers' (see the module's
  doc). `attach(node)` joins it to a running node; until then (and without peers) every file comes from the hub."""

  def __init__(self, node_id: str):
    self.node_id = node_id
    self.node = None
    self.port: Optional[int] = None  # the API port peers fetch this node's files from
    self.peers: Dict[str, PeerHoldings] = {}
    self.wanted: Dict[str, int] = {}  # repository -> downloads of it running here
    self.fetching: Dict[str, Set[str]] = {}  # repository -> files this node fetches from the hub now
    self._changed = asyncio.Event()
    self._task: Optional[asyncio.Task] = None
    self._announce_soon: Optional[asyncio.Handle] = None
    self._version = 0
    self._met: Dict[str, float] = {}  # peer -> when this node first looked for its announcement

  # --- joining the node ---

  def attach(self, node, app, port: int, upload_rate: Optional[float] = None) -> None:
    """Serve this node's files on the API app (before it starts) that listens on `port`, at most `upload_rate`
    bytes/s per transfer; hear and make announcements."""
    self.node, self.port = node, port
    PeerFileRoutes(node.is_member_host, upload_rate).add_to(app)
    node.inbox.observe(statuses.PEER_FILES, self._heard)
    self._task = asyncio.create_task(self._announce_periodically())

  async def stop(self) -> None:
    if self._task is not None:
      self._task.cancel()
      await asyncio.gather(self._task, return_exceptions=True)

  async def _announce_periodically(self) -> None:
    while True:
      try:
        await self.announce()
      except Exception as e:  # noqa: BLE001 (a failed announcement must not end the loop; the next one may pass)
        log.warning("exo: could not announce this node's model files: %r", e)
      await asyncio.sleep(ANNOUNCE_INTERVAL_S)

  async def announce(self) -> None:
    if self.node is None:
      return
    repos = {}
    held = await asyncio.to_thread(held_repos)
    # What fits one status (statuses.py's bounds): the repositories this node downloads first, none too large.
    for repo_id in sorted(held, key=lambda r: (r not in self.wanted, r))[:ANNOUNCED_REPOS]:
      record = held[repo_id]
      if len(record.files) > statuses.MAX_REPO_FILES:
        continue
      repos[repo_id] = {"commit": record.commit, "files": {p: _file_entry(f) for p, f in record.files.items()},
                        "verified": sorted(record.verified), "fetching": sorted(self.fetching.get(repo_id, set()) & set(record.files)),
                        "wants": self.wanted.get(repo_id, 0) > 0}
    # The state as of now, stamped so: an announcement that overtakes an older one on the way is not undone by it.
    self._version = max(self._version + 1, time.time_ns())
    status = statuses.PeerFiles.build(node_id=self.node_id, version=self._version, port=self.port, offline=hub.offline(), repos=repos)
    await self.node.broadcast_opaque_status("", status, to={p.id() for p in self.node.peers})

  def announce_now(self) -> None:
    """Announce on the next loop turn (changes made together go out as one announcement)."""
    if self.node is None or self._announce_soon is not None:
      return

    def send():
      self._announce_soon = None
      self.node.spawn(self.announce())
    self._announce_soon = asyncio.get_running_loop().call_soon(send)

  def _heard(self, request_id: str, status: statuses.PeerFiles, sender_host: Optional[str]) -> None:
    node_id = status.node_id
    if sender_host is None or node_id == self.node_id or sender_host not in self.node.peer_hosts.get(node_id, ()):
      return  # only a member speaks for itself
    known = self.peers.get(node_id)
    if known is not None and status.version < known.version:
      return  # sent before the one already heard
    self.peers[node_id] = PeerHoldings(node_id, status.version, status.port, status.offline, status.repos, time.monotonic())
    self._changed.set()
    self._changed = asyncio.Event()

  # --- the peers' holdings ---

  def _live(self) -> List[PeerHoldings]:
    if self.node is None:
      return []
    now = time.monotonic()
    return [p for p in self.peers.values() if p.node_id in self.node.peer_hosts and now - p.heard < STALE_S]

  @staticmethod
  def _repo(peer: PeerHoldings, repo_id: str) -> statuses.RepoHoldings:
    return peer.repos.get(repo_id, _NOTHING_HELD)

  def _url(self, peer: PeerHoldings, repo_id: str, path: str) -> Optional[Tuple[str, int]]:
    """(the file's URL at the peer, its cost: 0 on this machine, 1 elsewhere), or None if the peer has no address."""
    hosts = sorted(self.node.peer_hosts.get(peer.node_id, ()))
    if not hosts:
      return None
    host = hosts[0]
    try:
      cost = 0 if ipaddress.ip_address(host).is_loopback or host in _own_addresses() else 1
    except ValueError:
      cost = 1
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{peer.port}{FILES_PREFIX}/{repo_id}/{path}", cost

  def listing(self, repo_id: str) -> Optional[RepoListing]:
    """The repository's file list as the peer holding most of it has it (for a node that cannot ask the hub)."""
    holders = [p for p in self._live() if self._repo(p, repo_id).verified]
    if not holders:
      return None
    best = max(holders, key=lambda p: (len(p.repos[repo_id].verified), p.node_id))
    repo = best.repos[repo_id]
    return RepoListing(repo.commit, {path: HubFile(path, *entry) for path, entry in repo.files.items()})

  def holders(self, repo_id: str, file: HubFile, excluded: Set[str]) -> List[Source]:
    """Peers holding the file verified with the same size and hash, cheapest first (equals spread by file)."""
    found = []
    for peer in self._live():
      repo = peer.repos.get(repo_id)
      if peer.node_id in excluded or repo is None or file.path not in repo.verified or repo.files.get(file.path) != _file_entry(file):
        continue
      where = self._url(peer, repo_id, file.path)
      if where is not None:
        found.append((where[1], peer.node_id, where[0]))
    if not found:
      return []
    cheapest = min(cost for cost, _, _ in found)
    first = _spread(file.path, sorted(node_id for cost, node_id, _ in found if cost == cheapest))
    found.sort(key=lambda f: (f[0], f[1] != first, f[1]))
    return [Source(f"peer {node_id} ({url.split('/exo/')[0]})", url, {}, PEER_ATTEMPTS, node_id) for _, node_id, url in found]

  def hub_fetcher(self, repo_id: str, path: str) -> Optional[str]:
    """A live peer fetching the file from the hub now, if any."""
    return next((p.node_id for p in self._live() if path in self._repo(p, repo_id).fetching), None)

  def rival_fetcher(self, repo_id: str, path: str, excluded: Set[str] = frozenset()) -> Optional[str]:
    """A live peer (not excluded) with a lower node id that fetches (or has claimed) the file from the hub too: it
    goes first."""
    return min((p.node_id for p in self._live() if p.node_id < self.node_id and p.node_id not in excluded
                and path in self._repo(p, repo_id).fetching), default=None)

  def chosen_hub_fetcher(self, repo_id: str, path: str) -> str:
    """Of the nodes downloading the repository now that can reach the hub (this one among them), the one that
    fetches this file from it."""
    wanting = [p.node_id for p in self._live() if self._repo(p, repo_id).wants and not p.offline]
    return _spread(f"{repo_id}/{path}", sorted({self.node_id, *wanting}))

  def may_bring(self, repo_id: str) -> bool:
    """Whether a live peer is downloading the repository and can reach the hub (a file may yet appear there)."""
    return any(self._repo(p, repo_id).wants and not p.offline for p in self._live())

  def has_peers(self) -> bool:
    return bool(self._live()) or bool(self.node is not None and self.node.peers)

  def unheard_for(self) -> float:
    """Seconds until every peer has announced its files or has been a peer for FIRST_WORD_S without a word (0: now)."""
    if self.node is None:
      return 0.0
    now = time.monotonic()
    unheard = [self._met.setdefault(p.id(), now) for p in self.node.peers if p.id() not in self.peers]
    return max([0.0] + [met + FIRST_WORD_S - now for met in unheard])

  async def heard_every_peer(self) -> None:
    """Until unheard_for() is 0. A node that (re)joins a ring asks for its files at once; without this it would take
    from the hub a file its peer holds."""
    while (left := self.unheard_for()) > 0:
      await self.changed(left)

  async def changed(self, timeout: float) -> None:
    """Until a peer's next announcement, or `timeout` seconds."""
    try:
      await asyncio.wait_for(self._changed.wait(), timeout)
    except asyncio.TimeoutError:
      pass

  # --- this node's downloads ---

  @contextmanager
  def wanting(self, repo_id: str) -> Iterator[None]:
    self.wanted[repo_id] = self.wanted.get(repo_id, 0) + 1
    self.announce_now()
    try:
      yield
    finally:
      self.wanted[repo_id] -= 1
      if not self.wanted[repo_id]:
        del self.wanted[repo_id]
      self.announce_now()

  @contextmanager
  def fetching_from_hub(self, repo_id: str, path: str) -> Iterator[None]:
    self.fetching.setdefault(repo_id, set()).add(path)
    self.announce_now()
    try:
      yield
    finally:
      self.fetching[repo_id].discard(path)
      self.announce_now()


_OWN: Tuple[float, Set[str]] = (0.0, set())


def _own_addresses() -> Set[str]:
  global _OWN
  if time.monotonic() - _OWN[0] > 30:
    from exo.api.access import own_hosts
    _OWN = (time.monotonic(), own_hosts())
  return _OWN[1]

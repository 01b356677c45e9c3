"""A node's files for the other nodes of its cluster, served on its API server: the model files it holds verified, so that a model
crosses the internet once per cluster (exo/download/cluster_files.py decides who fetches what from whom).

Trusted peers only. A caller whose address is not a ring member's (the rule the gRPC server applies, see
RingMember.is_member_host) gets 403 for every path, before anything is looked up, so it learns nothing: not what is
held, not what exists. A member may read only a file that a download folder's record (`.exo-download.json`, see
record.py) calls verified and that is still that size: never a partial file, nothing outside
$EXO_HOME/downloads/<org>--<repo>, nothing a symlink leads out of it.

  GET /exo/files                          what this node holds verified: repository -> {commit, verified paths}
  GET /exo/files/{org}/{name}/{path}      one verified file's bytes (Range requests get 206)

A node serves its files this way only while its API server runs (`exo run` does not serve).
EXO_PEER_UPLOAD_BYTES_PER_S caps what this node sends its peers per transfer (unset: as fast as the link goes)."""
import asyncio
import ipaddress
from pathlib import Path
from typing import Callable, Dict, Optional

from aiohttp import web

from exo import settings
from exo.download.record import RECORD_NAME, DownloadRecord
from exo.download.shard_files import repo_dir
from exo.helpers import exo_home

CHUNK = 1 << 20
SEND_PIECE = 4 << 20
FILES_PREFIX = "/exo/files"


def downloads_root() -> Path:
  return exo_home() / "downloads"


def held_repos() -> Dict[str, DownloadRecord]:
  """The download records under $EXO_HOME/downloads, by repository, each with only the files still verified on disk."""
  held = {}
  root = downloads_root()
  if not root.is_dir():
    return held
  for record_path in sorted(root.glob(f"*/{RECORD_NAME}")):
    folder = record_path.parent
    record = DownloadRecord.load(folder)
    if record is None or repo_dir(record.repo_id) != folder:
      continue
    record.verified = {p: size for p, size in record.verified.items() if p in record.files and _servable(folder, record, p) is not None}
    held[record.repo_id] = record
  return held


def verified_file(repo_id: str, path: str) -> Optional[Path]:
  """The file on disk if the repository's record calls it verified and it lies inside the repository's folder."""
  if "\\" in repo_id or repo_id.count("/") != 1 or any(part in ("", ".", "..") for part in repo_id.split("/")):
    return None
  folder = repo_dir(repo_id)
  record = DownloadRecord.load(folder)
  if record is None or record.repo_id != repo_id:
    return None
  return _servable(folder, record, path)


def _servable(folder: Path, record: DownloadRecord, path: str) -> Optional[Path]:
  if path not in record.verified or not record.is_verified(folder, path):
    return None
  target = (folder / path).resolve()
  if not target.is_relative_to(folder.resolve()) or target.name.endswith(".partial") or target.name == RECORD_NAME:
    return None
  return target


def upload_rate(environ) -> Optional[float]:
  """EXO_PEER_UPLOAD_BYTES_PER_S: None when unset; ValueError when it is not a positive number."""
  raw = settings.env("EXO_PEER_UPLOAD_BYTES_PER_S", "", environ).strip()
  if not raw:
    return None
  try:
    rate = float(raw)
  except ValueError:
    raise ValueError(f"EXO_PEER_UPLOAD_BYTES_PER_S must be a number of bytes per second, got {raw!r}") from None
  if rate <= 0:
    raise ValueError(f"EXO_PEER_UPLOAD_BYTES_PER_S must be positive, got {raw!r}")
  return rate


def caller_address(remote: Optional[str]) -> Optional[str]:
  """The caller's IP address as ring members are known by: an IPv4 address that reached an IPv6 socket as
  ::ffff:a.b.c.d is a.b.c.d."""
  try:
    address = ipaddress.ip_address((remote or "").split("%")[0])
  except ValueError:
    return None
  return str(address.ipv4_mapped or address) if isinstance(address, ipaddress.IPv6Address) else str(address)


class PeerFileRoutes:
  """The routes, on the node's API server: GETs under FILES_PREFIX answer callers `is_member(ip)` accepts, and 403
  anyone else, whatever the path (the API key does not apply to them: ring membership does)."""

  def __init__(self, is_member: Callable[[Optional[str]], bool], rate: Optional[float] = None):
    self.is_member, self.rate = is_member, rate

  def add_to(self, app: web.Application) -> None:
    app.router.add_get(FILES_PREFIX + "{tail:(/.*)?}", self._handle)

  async def _handle(self, request: web.Request) -> web.StreamResponse:
    if not self.is_member(caller_address(request.remote)):
      return web.json_response({"error": "forbidden"}, status=403)  # the same answer for every path: nothing learned
    tail = request.match_info["tail"].strip("/")
    if not tail:
      held = await asyncio.to_thread(held_repos)
      return web.json_response({repo_id: {"commit": r.commit, "verified": sorted(r.verified)} for repo_id, r in held.items()})
    parts = tail.split("/", 2)
    target = None if len(parts) < 3 else await asyncio.to_thread(verified_file, f"{parts[0]}/{parts[1]}", parts[2])
    if target is None:
      return web.json_response({"error": "not held verified here"}, status=404)
    if self.rate is None:
      # Large pieces: where the loop has no sendfile (uvloop, which nodes run on), aiohttp reads the file in pieces
      # of this size on a worker thread, one trip per piece.
      return web.FileResponse(target, chunk_size=SEND_PIECE, headers={"Content-Type": "application/octet-stream"})
    return await self._paced(request, target)

  async def _paced(self, request: web.Request, target: Path) -> web.StreamResponse:
    """The file at EXO_PEER_UPLOAD_BYTES_PER_S (from the Range's start, if any)."""
    size = target.stat().st_size
    start = request.http_range.start or 0
    if start >= size > 0:
      return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
    headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size - start), "Accept-Ranges": "bytes"}
    if start:
      headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
    response = web.StreamResponse(status=206 if start else 200, headers=headers)
    await response.prepare(request)
    piece = max(1, min(CHUNK, int(self.rate / 10)))
    with open(target, "rb") as handle:
      handle.seek(start)
      while block := await asyncio.to_thread(handle.read, piece):
        await response.write(block)
        await asyncio.sleep(len(block) / self.rate)
    await response.write_eof()
    return response

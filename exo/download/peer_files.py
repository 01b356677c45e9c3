"""A node's file server for the other nodes of its cluster: the model files it holds verified, so that a model
crosses the internet once per cluster (exo/download/cluster_files.py decides who fetches what from whom).

Trusted peers only. A caller whose address is not a ring member's (the rule the gRPC server applies, see
RingMember.is_member_host) gets 403 for every path, before anything is looked up, so it learns nothing: not what is
held, not what exists. A member may read only a file that a download folder's record (`.exo-download.json`, see
record.py) calls verified and that is still that size: never a partial file, nothing outside
$EXO_HOME/downloads/<org>--<repo>, nothing a symlink leads out of it.

  GET /exo/files                          what this node holds verified: repository -> {commit, verified paths}
  GET /exo/files/{org}/{name}/{path}      one verified file's bytes (Range requests get 206)

EXO_PEER_UPLOAD_BYTES_PER_S caps what this node sends its peers per transfer (unset: as fast as the link goes)."""
import asyncio
import os
from pathlib import Path
from typing import Callable, Dict, Optional

from aiohttp import web

from exo.download.record import RECORD_NAME, DownloadRecord
from exo.download.shard_files import repo_dir
from exo.helpers import exo_home

CHUNK = 1 << 20
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


def _upload_rate() -> Optional[float]:
  raw = os.environ.get("EXO_PEER_UPLOAD_BYTES_PER_S", "").strip()
  if not raw:
    return None
  try:
    rate = float(raw)
  except ValueError:
    raise ValueError(f"EXO_PEER_UPLOAD_BYTES_PER_S must be a number of bytes per second, got {raw!r}") from None
  if rate <= 0:
    raise ValueError(f"EXO_PEER_UPLOAD_BYTES_PER_S must be positive, got {raw!r}")
  return rate


class PeerFileServer:
  """Serves verified files to callers `is_member(ip)` accepts. `port` 0: any free one (`port` is set once it listens)."""

  def __init__(self, is_member: Callable[[Optional[str]], bool], host: str, port: int = 0):
    self.is_member, self.host, self.port = is_member, host, port
    self.rate = _upload_rate()
    self.runner: Optional[web.AppRunner] = None
    app = web.Application(middlewares=[self._members_only])
    app.router.add_get(FILES_PREFIX, self._list)
    app.router.add_get(FILES_PREFIX + "/{org}/{name}/{path:.+}", self._file)
    self.app = app

  async def start(self) -> None:
    self.runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
    await self.runner.setup()
    site = web.TCPSite(self.runner, self.host, self.port)
    await site.start()
    self.port = site._server.sockets[0].getsockname()[1]

  async def stop(self) -> None:
    if self.runner is not None:
      await self.runner.cleanup()
      self.runner = None

  @web.middleware
  async def _members_only(self, request: web.Request, handler):
    if not self.is_member(request.remote):
      return web.json_response({"error": "forbidden"}, status=403)  # the same answer for every path: nothing learned
    return await handler(request)

  async def _list(self, request: web.Request) -> web.Response:
    held = await asyncio.to_thread(held_repos)
    return web.json_response({repo_id: {"commit": r.commit, "verified": sorted(r.verified)} for repo_id, r in held.items()})

  async def _file(self, request: web.Request) -> web.StreamResponse:
    repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
    target = await asyncio.to_thread(verified_file, repo_id, request.match_info["path"])
    if target is None:
      return web.json_response({"error": "not held verified here"}, status=404)
    if self.rate is None:
      return web.FileResponse(target, headers={"Content-Type": "application/octet-stream"})
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

"""A stand-in for the Hugging Face Hub on a loopback port, serving repositories a test writes, so that exo's real
download code (and huggingface_hub under it) runs against it through HF_ENDPOINT. It speaks the part of the Hub's
protocol huggingface_hub 2.x uses to list and fetch a model (read from its file_download.py, _snapshot_download.py
and hf_api.py):

  GET  /api/models/{org}/{name}[/revision/{rev}]      model info: id, sha (the commit), siblings; ?blobs=true adds
                                                      each file's size, blobId (git blob id) and lfs {size, sha256, pointerSize}
  GET  /api/models/{org}/{name}/tree/{rev}[/{path}]   the file tree: type, oid, size, path (and lfs) of every file
  HEAD|GET /{org}/{name}/resolve/{rev}/{path}         the file: X-Repo-Commit, ETag (the sha256 of an LFS file, with
                                                      X-Linked-ETag and X-Linked-Size, else its blob id), Content-Length,
                                                      Accept-Ranges; a Range header gets 206 and Content-Range

Errors carry the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) and X-Error-Message.
`rev` may be "main" or the commit. The faults tests need: `go_down` (connections refused, or every answer a 503) and
`come_back`; a byte rate (a slow hub); a connection dropped once after so many bytes of a file; a file that is
listed but not served, or served with other bytes than announced; a gated repository that only a token opens.
Every request is logged (`requests`), so tests can see which files were fetched and from which byte, and the bytes
sent of each file are counted (`bytes_sent`)."""
import asyncio
import hashlib
import threading
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Dict, List, Optional, Set

from aiohttp import web

from tests.support.cluster import free_port

CHUNK = 16 * 1024
LFS_PATTERNS = ("*.safetensors",)  # stored as LFS files on the real hub too


def git_blob_id(data: bytes) -> str:
  return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
  repo_id: str
  files: Dict[str, bytes]
  gated_token: Optional[str] = None  # set: only `Authorization: Bearer <it>` gets in
  unserved: Set[str] = field(default_factory=set)  # listed, but resolve answers 404
  served_instead: Dict[str, bytes] = field(default_factory=dict)  # listed with the real bytes' hash, these bytes served

  def __post_init__(self):  # the files do not change once served: their hashes are taken once
    self.sha256 = {path: hashlib.sha256(data).hexdigest() for path, data in self.files.items()}
    self.commit = hashlib.sha1("".join(f"{p}\0{h}" for p, h in sorted(self.sha256.items())).encode()).hexdigest()

  def is_lfs(self, path: str) -> bool:
    return any(fnmatch(path, p) for p in LFS_PATTERNS)

  def entry(self, path: str) -> dict:
    """A file as model info (blobs=true) lists it."""
    data = self.files[path]
    if not self.is_lfs(path):
      return {"rfilename": path, "size": len(data), "blobId": git_blob_id(data)}
    sha256 = self.sha256[path]
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {len(data)}\n".encode()
    return {"rfilename": path, "size": len(data), "blobId": git_blob_id(pointer), "lfs": {"size": len(data), "sha256": sha256, "pointerSize": len(pointer)}}

  def etag(self, path: str) -> str:
    entry = self.entry(path)
    return entry["lfs"]["sha256"] if "lfs" in entry else entry["blobId"]


@dataclass
class Logged:
  method: str
  repo_id: str
  path: str  # the file, or the API route
  range: Optional[str]
  authorized: bool


class StandInHub:
  def __init__(self):
    self.repos: Dict[str, HubRepo] = {}
    self.requests: List[Logged] = []
    self.bytes_per_second: Optional[float] = None  # None: as fast as the loop goes
    self.answer_503 = False
    self.refusing = False
    self.drops: Dict[str, int] = {}  # file path -> drop the connection once after this many bytes of it
    self.bytes_sent: Dict[str, int] = {}  # file path -> the bytes of it sent, all fetches together
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.loop = asyncio.new_event_loop()
    self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=f"stand-in-hub-{self.port}")
    self.runner: Optional[web.AppRunner] = None
    self.site: Optional[web.TCPSite] = None

  # --- content ---

  def add_repo(self, repo_id: str, folder: Path, **faults) -> HubRepo:
    """Serve the files of `folder` (written by the test) as repository `repo_id`."""
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    self.repos[repo_id] = HubRepo(repo_id, files, **faults)
    return self.repos[repo_id]

  def fetches(self, path: str, repo_id: Optional[str] = None) -> List[Optional[str]]:
    """The Range header of each GET of a file (None: from its start)."""
    return [r.range for r in self.requests if r.method == "GET" and r.path == path and repo_id in (None, r.repo_id)]

  # --- running ---

  def _call(self, coro):
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

  def start(self) -> "StandInHub":
    self.thread.start()
    self._call(self._start())
    return self

  async def _start(self) -> None:
    app = web.Application()
    app.router.add_get("/api/models/{org}/{name}", self._model_info)
    app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._model_info)
    app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self._tree)
    app.router.add_get("/api/models/{org}/{name}/tree/{rev}/{path:.*}", self._tree)
    app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.*}", self._resolve)
    self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await self.runner.setup()
    await self._listen()

  async def _listen(self) -> None:
    self.site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
    await self.site.start()

  def go_down(self, refuse: bool = True) -> None:
    """Unreachable: connections refused (refuse=True), or every request answered 503."""
    if refuse:
      self._call(self.site.stop())
      self.refusing = True
    else:
      self.answer_503 = True

  def come_back(self) -> None:
    self.answer_503 = False
    if self.refusing:
      self._call(self._listen())
      self.refusing = False

  def stop(self) -> None:
    if self.thread.is_alive():
      self._call(self.runner.cleanup())
      self.loop.call_soon_threadsafe(self.loop.stop)
      self.thread.join(10)

  # --- the protocol ---

  def _repo(self, request: web.Request, what: str) -> HubRepo:
    repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
    token = request.headers.get("Authorization", "")
    self.requests.append(Logged(request.method, repo_id, what, request.headers.get("Range"), bool(token)))
    if self.answer_503:
      raise _error(503, "ServiceUnavailable", "the stand-in hub is down")
    repo = self.repos.get(repo_id)
    if repo is None:
      raise _error(404, "RepoNotFound", "Repository not found")
    if repo.gated_token is not None and token != f"Bearer {repo.gated_token}":
      raise _error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access to it and be authenticated to access it.")
    rev = request.match_info.get("rev", "main")
    if rev not in ("main", repo.commit):
      raise _error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
    return repo

  async def _model_info(self, request: web.Request) -> web.Response:
    repo = self._repo(request, "model_info")
    blobs = request.query.get("blobs", "").lower() == "true"
    siblings = [repo.entry(p) if blobs else {"rfilename": p} for p in repo.files]
    return web.json_response({"id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.commit, "private": False,
                              "gated": "manual" if repo.gated_token else False, "disabled": False, "tags": [], "siblings": siblings})

  async def _tree(self, request: web.Request) -> web.Response:
    repo = self._repo(request, "tree")
    prefix = request.match_info.get("path", "").strip("/")
    entries = []
    for path in repo.files:
      if prefix and not path.startswith(prefix + "/"):
        continue
      entry = repo.entry(path)
      tree_entry = {"type": "file", "oid": entry["blobId"], "size": entry["size"], "path": path}
      if "lfs" in entry:
        tree_entry["lfs"] = {"oid": entry["lfs"]["sha256"], "size": entry["size"], "pointerSize": entry["lfs"]["pointerSize"]}
      entries.append(tree_entry)
    return web.json_response(entries)

  async def _resolve(self, request: web.Request) -> web.StreamResponse:
    path = request.match_info["path"]
    repo = self._repo(request, path)
    if request.method not in ("GET", "HEAD"):
      raise web.HTTPMethodNotAllowed(request.method, ["GET", "HEAD"])
    if path not in repo.files or path in repo.unserved:
      raise _error(404, "EntryNotFound", f"{path} does not exist on main")
    data = repo.served_instead.get(path, repo.files[path])
    headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.etag(path)}"', "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
    if repo.is_lfs(path):
      headers.update({"X-Linked-ETag": f'"{repo.etag(path)}"', "X-Linked-Size": str(len(repo.files[path]))})
    start, status = 0, 200
    if request.http_range.start is not None:
      start = request.http_range.start
      if start >= len(data):
        raise web.HTTPRequestRangeNotSatisfiable(headers={"Content-Range": f"bytes */{len(data)}"})
      status = 206
      headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
    headers["Content-Length"] = str(len(data) - start)
    response = web.StreamResponse(status=status, headers=headers)
    await response.prepare(request)
    if request.method == "HEAD":
      return response
    drop_at = self.drops.pop(path, None)
    sent, position = 0, start
    while position < len(data):
      piece = data[position:position + CHUNK]
      if drop_at is not None and sent + len(piece) > drop_at:
        await response.write(piece[:drop_at - sent])
        self.bytes_sent[path] = self.bytes_sent.get(path, 0) + drop_at - sent
        request.transport.close()  # the connection drops mid-file
        return response
      await response.write(piece)
      self.bytes_sent[path] = self.bytes_sent.get(path, 0) + len(piece)
      sent, position = sent + len(piece), position + len(piece)
      if self.bytes_per_second:
        await asyncio.sleep(len(piece) / self.bytes_per_second)
    await response.write_eof()
    return response


_ERRORS = {401: web.HTTPUnauthorized, 404: web.HTTPNotFound, 503: web.HTTPServiceUnavailable}


def _error(status: int, code: str, message: str) -> web.HTTPException:
  return _ERRORS[status](headers={"X-Error-Code": code, "X-Error-Message": message}, text=message)

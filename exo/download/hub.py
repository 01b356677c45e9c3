"""Talking to the Hugging Face Hub, or to the mirror HF_ENDPOINT names: a repository's files at its current commit
(with the size and hash the hub announces for each), and one file's bytes.

huggingface_hub makes the listing call and the headers (HF_TOKEN, its user agent). The bytes themselves stream here,
over aiohttp, into `<file>.partial` beside where the file goes: a later attempt, even after a restart, resumes
from what the partial file holds (an HTTP Range request); once every byte is there its hash is compared with the
one the hub announced, and only then is it renamed into place.

What a failure costs before it is reported: a call waits at most HUB_TIMEOUT_S for a connection, and then for each
next piece of the answer. A call that fails for a reason that may pass (refused, reset, a 5xx, 429, a timeout) is
tried ATTEMPTS times in all, BACKOFF_S apart. A stream that breaks after bytes arrived resumes at once; only
attempts that bring no byte count. A missing repository or file, a refusal (gated), bytes that differ from what
was announced and a full disk are not retried."""
import asyncio
import errno
import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import aiohttp

from exo.download.errors import DownloadFailure

HUB_TIMEOUT_S = 10.0
ATTEMPTS = 3
BACKOFF_S = 0.5  # doubled after each failed attempt
CHUNK = 1 << 20
TRANSIENT_STATUSES = {408, 429, 500, 502, 503, 504}
REVISION = "main"


@dataclass(frozen=True)
class HubFile:
  """One file of a repository as the hub announces it: its size, and its hash (sha256 for LFS files, the git blob
  id for the others)."""
  path: str
  size: int
  sha256: Optional[str] = None
  blob_id: Optional[str] = None

  def to_dict(self) -> dict:
    return {"path": self.path, "size": self.size, "sha256": self.sha256, "blob_id": self.blob_id}

  @classmethod
  def from_dict(cls, data: dict) -> "HubFile":
    return cls(str(data["path"]), int(data["size"]), data.get("sha256"), data.get("blob_id"))


@dataclass(frozen=True)
class RepoListing:
  commit: str
  files: Dict[str, HubFile]


def endpoint() -> str:
  from huggingface_hub import constants
  return constants.ENDPOINT.rstrip("/")


def offline() -> bool:
  """HF_HUB_OFFLINE=1: nothing is asked of the hub; only what is complete on disk is served."""
  from huggingface_hub import constants
  return bool(constants.HF_HUB_OFFLINE)


def _has_token() -> bool:
  from huggingface_hub import get_token
  return get_token() is not None


def _is_timeout(e: BaseException) -> bool:
  # huggingface_hub's HTTP library has changed over its versions (requests, httpx, httpx2); their timeouts all say so in their names
  return isinstance(e, (asyncio.TimeoutError, TimeoutError)) or "Timeout" in type(e).__name__


def _transport_failure(e: BaseException, name: Optional[str] = None) -> DownloadFailure:
  name = name or endpoint()
  if _is_timeout(e):
    return DownloadFailure("hub_timeout", f"{name} sent nothing within {HUB_TIMEOUT_S:g} s")
  return DownloadFailure("hub_unreachable", f"{name} did not answer ({type(e).__name__}: {e})")


def _gated(repo_id: str) -> DownloadFailure:
  if _has_token():
    return DownloadFailure("gated", f"the hub refused the HF_TOKEN this node has: its account has not been granted access to {repo_id}")
  return DownloadFailure("gated", f"{repo_id} needs an account that has been granted access: set HF_TOKEN to a token of one on this node")


def _listing_failure(e: Exception, repo_id: str) -> "tuple[DownloadFailure, bool]":
  """The failure a listing call met, and whether trying again may help."""
  from huggingface_hub.utils import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
  if isinstance(e, GatedRepoError):
    return _gated(repo_id), False
  if isinstance(e, RevisionNotFoundError):
    return DownloadFailure("repo_not_found", f"the hub has no revision {REVISION} of {repo_id}"), False
  if isinstance(e, RepositoryNotFoundError):
    private = "HF_TOKEN gives no access to it" if _has_token() else "a private one needs HF_TOKEN"
    return DownloadFailure("repo_not_found", f"the hub has no repository {repo_id} ({private})"), False
  if isinstance(e, HfHubHTTPError) and e.response is not None:
    status = e.response.status_code
    if status in (401, 403):
      return _gated(repo_id), False
    return DownloadFailure("hub_unreachable", f"{endpoint()} answered HTTP {status} to the file list"), status in TRANSIENT_STATUSES
  return _transport_failure(e), True


async def list_repo(repo_id: str) -> RepoListing:
  """The repository's files at the commit its main branch is on now."""
  from huggingface_hub import HfApi

  def call():
    return HfApi(endpoint=endpoint()).model_info(repo_id, revision=REVISION, files_metadata=True, timeout=HUB_TIMEOUT_S)
  started = time.monotonic()
  for attempt in range(ATTEMPTS):
    try:
      info = await asyncio.to_thread(call)
      break
    except Exception as e:
      failure, transient = _listing_failure(e, repo_id)
      if not transient:
        raise failure from e
      if attempt == ATTEMPTS - 1:
        raise DownloadFailure(failure.kind, f"{failure.detail}; {ATTEMPTS} tries over {time.monotonic() - started:.1f} s") from e
      await asyncio.sleep(BACKOFF_S * 2**attempt)
  if not info.sha or info.siblings is None or any(s.size is None for s in info.siblings):
    raise DownloadFailure("hub_unreachable", f"{endpoint()} listed {repo_id} without its commit or its files' sizes")
  files = {s.rfilename: HubFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, None if s.lfs else s.blob_id) for s in info.siblings}
  return RepoListing(info.sha, files)


class FileHash:
  """The hash the hub announces for a file, computed over its bytes as they come."""

  def __init__(self, file: HubFile):
    self.file = file
    self.reset()

  def reset(self) -> None:
    if self.file.sha256:
      self.hash, self.expected = hashlib.sha256(), self.file.sha256.lower()
    elif self.file.blob_id:
      self.hash, self.expected = hashlib.sha1(b"blob %d\0" % self.file.size), self.file.blob_id.lower()  # git's blob id
    else:
      self.hash, self.expected = None, None

  def update(self, data: bytes) -> None:
    if self.hash is not None:
      self.hash.update(data)

  def mismatch(self) -> Optional[str]:
    """None if the bytes are the announced ones (or the hub announced no hash), else what differs."""
    if self.hash is None or self.hash.hexdigest() == self.expected:
      return None
    return f"{self.file.path} hashes to {self.hash.hexdigest()[:16]}…, the hub announced {self.expected[:16]}…"


def file_matches(path: Path, file: HubFile) -> bool:
  """Whether a file on disk is the one the hub announced: its size, and its hash where there is one."""
  if not path.is_file() or path.stat().st_size != file.size:
    return False
  digest = FileHash(file)
  with open(path, "rb") as f:
    while block := f.read(CHUNK):
      digest.update(block)
  return digest.mismatch() is None


class _Partial:
  """`<file>.partial`: what has arrived of a file, with the hash of it. Its methods do file I/O (call them off the
  event loop)."""

  def __init__(self, path: Path, file: HubFile):
    self.path, self.digest, self.handle = path, FileHash(file), None

  def open(self) -> int:
    """Open it for appending, hashing what it already holds; return its size."""
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.handle = open(self.path, "ab+")
    self.handle.seek(0)
    while block := self.handle.read(CHUNK):
      self.digest.update(block)
    return self.handle.tell()

  def write(self, data: bytes) -> None:
    self.handle.write(data)
    self.digest.update(data)

  def restart(self) -> None:
    self.handle.truncate(0)
    self.digest.reset()

  def close(self) -> None:
    if self.handle is not None:
      self.handle.close()


class _Transient(Exception):
  """A failure that may pass (a 5xx, a dropped stream): the next attempt resumes, or starts the file again."""

  def __init__(self, message: str, start_again: bool = False):
    super().__init__(message)
    self.start_again = start_again


@dataclass(frozen=True)
class Source:
  """Where a file's bytes come from: the hub, or a peer that holds the file verified (exo/download/peer_files.py).
  `name` stands for it in messages; a stream that brings nothing `attempts` times in a row fails."""
  name: str
  url: str
  headers: Dict[str, str]
  attempts: int = ATTEMPTS
  peer: Optional[str] = None  # the peer's node id, or None for the hub


def hub_source(repo_id: str, commit: str, path: str) -> Source:
  from huggingface_hub import hf_hub_url
  from huggingface_hub.utils import build_hf_headers
  return Source(endpoint(), hf_hub_url(repo_id, path, revision=commit, endpoint=endpoint()), dict(build_hf_headers()))


def _check_status(response: aiohttp.ClientResponse, source: Source, repo_id: str, commit: str, file: HubFile) -> None:
  status = response.status
  if status in (200, 206):
    return
  if status == 404:
    raise DownloadFailure("file_not_found", f"{source.name} has no {file.path} in {repo_id} at commit {commit[:12]} although it listed it")
  if status in (401, 403):
    if source.peer is not None:
      raise DownloadFailure("hub_unreachable", f"{source.name} refused to serve {file.path} (HTTP {status})")
    raise _gated(repo_id)
  if status in TRANSIENT_STATUSES or status == 416:  # 416: the partial file is not a prefix the hub knows
    raise _Transient(f"{source.name} answered HTTP {status} for {file.path}", start_again=status == 416)
  raise DownloadFailure("hub_unreachable", f"{source.name} answered HTTP {status} for {file.path}")


async def _pieces(stream: aiohttp.StreamReader):
  """The stream's bytes in pieces of about CHUNK: what has arrived, gathered, so that a fast source (a peer on the
  LAN) costs one trip to the writing thread per CHUNK, not one per network read."""
  parts, size = [], 0
  async for data in stream.iter_any():
    parts.append(data)
    size += len(data)
    if size >= CHUNK:
      yield b"".join(parts)
      parts, size = [], 0
  if parts:
    yield b"".join(parts)


async def fetch_file(session: aiohttp.ClientSession, source: Source, repo_id: str, commit: str, file: HubFile, folder: Path,
                     on_bytes: Callable[[int], None]) -> None:
  """Make `folder/<file.path>` the file the hub announced, from `source`: resume its partial file (whoever brought
  its bytes so far), check the hash, rename it into place. `on_bytes(n)` hears of every n bytes that arrive (n < 0
  when the source ignored a Range and it starts again)."""
  final = folder / file.path
  partial = _Partial(final.with_name(final.name + ".partial"), file)
  headers = {**source.headers, "Accept-Encoding": "identity"}  # sizes and Ranges in the file's own bytes, not gzip's
  timeout = aiohttp.ClientTimeout(total=None, sock_connect=HUB_TIMEOUT_S, sock_read=HUB_TIMEOUT_S)
  try:
    have = await asyncio.to_thread(partial.open)
    if have > file.size:
      await asyncio.to_thread(partial.restart)
      on_bytes(-have)
      have = 0
    fruitless, started = 0, time.monotonic()
    while have < file.size:
      arrived = 0
      try:
        async with session.get(source.url, headers={**headers, "Range": f"bytes={have}-"} if have else headers, timeout=timeout) as response:
          _check_status(response, source, repo_id, commit, file)
          if have and response.status == 200:  # the source ignored the Range: the whole file comes again
            await asyncio.to_thread(partial.restart)
            on_bytes(-have)
            have = 0
          if response.content_length is not None and have + response.content_length != file.size:
            raise DownloadFailure("corrupt", f"{file.path}: the hub listed {file.size:,} bytes but {source.name} sends {have + response.content_length:,}")
          async for chunk in _pieces(response.content):
            if have + len(chunk) > file.size:
              raise DownloadFailure("corrupt", f"{file.path}: {source.name} sends more than the {file.size:,} bytes the hub listed")
            await asyncio.to_thread(partial.write, chunk)
            have, arrived = have + len(chunk), arrived + len(chunk)
            on_bytes(len(chunk))
      except (aiohttp.ClientError, asyncio.TimeoutError, _Transient) as e:
        fruitless = 0 if arrived else fruitless + 1
        if fruitless >= source.attempts:
          failure = DownloadFailure("hub_unreachable", str(e)) if isinstance(e, _Transient) else _transport_failure(e, source.name)
          raise DownloadFailure(failure.kind, f"{failure.detail} while fetching {file.path}; {source.attempts} tries over {time.monotonic() - started:.1f} s") from e
        if not arrived:
          await asyncio.sleep(BACKOFF_S * 2**(fruitless - 1))
        if getattr(e, "start_again", False):
          await asyncio.to_thread(partial.restart)
          on_bytes(-have)
          have = 0
    mismatch = partial.digest.mismatch()
    if mismatch is not None:
      partial.close()
      partial.path.unlink()  # a next attempt fetches it whole
      on_bytes(-have)
      raise DownloadFailure("corrupt", mismatch)
  except OSError as e:  # the disk's, not the network's (those are handled above)
    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
      raise
    raise DownloadFailure("disk_full", f"no space left on the disk of {folder} while writing {file.path}") from e
  finally:
    partial.close()
  os.replace(partial.path, final)

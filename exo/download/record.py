"""What a model's download folder holds, as far as exo has checked: the hub's list of the repository's files (commit,
size, hash) and which of them are on disk verified, kept in `<folder>/.exo-download.json`.

A file counts as there only when it is in that list, verified (its size and hash matched what the hub announced
when it arrived) and still of that size on disk. So a partial file, a failed download or a folder some older
version left half full is never taken for a complete one, and a node that is offline (or cannot reach the hub)
knows from the record alone whether it can serve a model."""
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional

from exo.download.hub import HubFile, RepoListing

RECORD_NAME = ".exo-download.json"


@dataclass
class DownloadRecord:
  repo_id: str
  commit: str
  files: Dict[str, HubFile]
  verified: Dict[str, int] = field(default_factory=dict)  # path -> its size when it was verified

  @classmethod
  def load(cls, folder: Path) -> Optional["DownloadRecord"]:
    try:
      data = json.loads((folder / RECORD_NAME).read_text())
      return cls(data["repo_id"], data["commit"], {p: HubFile.from_dict(f) for p, f in data["files"].items()},
                 {p: int(size) for p, size in data["verified"].items()})
    except (OSError, ValueError, KeyError, TypeError):
      return None  # none yet, or unreadable: nothing on disk counts as verified

  def save(self, folder: Path) -> None:
    """Atomically: a node killed mid-write leaves the previous record, never a broken one."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"repo_id": self.repo_id, "commit": self.commit, "files": {p: f.to_dict() for p, f in self.files.items()}, "verified": self.verified}
    temporary = folder / f"{RECORD_NAME}.{os.getpid()}.tmp"
    temporary.write_text(json.dumps(data, indent=1))
    os.replace(temporary, folder / RECORD_NAME)

  def relisted(self, listing: RepoListing) -> "DownloadRecord":
    """The record for the hub's current listing: a file stays verified only if the hub still announces it the same."""
    verified = {p: size for p, size in self.verified.items() if self.files.get(p) == listing.files.get(p)}
    return DownloadRecord(self.repo_id, listing.commit, dict(listing.files), verified)

  def is_verified(self, folder: Path, path: str) -> bool:
    size = self.verified.get(path)
    try:
      return size is not None and (folder / path).stat().st_size == size
    except OSError:
      return False

  def missing(self, folder: Path, paths: Iterable[str]) -> List[str]:
    return [p for p in paths if not self.is_verified(folder, p)]

  def bytes_on_disk(self, folder: Path, path: str) -> int:
    """A file's bytes here: all of them once verified, else what its partial file holds."""
    if self.is_verified(folder, path):
      return self.files[path].size
    try:
      return min((folder / f"{path}.partial").stat().st_size, self.files[path].size)
    except (OSError, KeyError):
      return 0

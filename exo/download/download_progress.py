from dataclasses import asdict, dataclass, field
from typing import Dict

from exo.inference.shard import Shard


@dataclass
class RepoFileProgressEvent:
  repo_id: str
  repo_revision: str
  file_path: str
  downloaded: int
  downloaded_this_session: int
  total: int
  speed: float
  eta: float  # seconds
  status: str
  start_time: float

  def to_dict(self) -> dict:
    return asdict(self)

  @classmethod
  def from_dict(cls, data: dict) -> "RepoFileProgressEvent":
    return cls(**data)


@dataclass
class RepoProgressEvent:
  shard: Shard
  repo_id: str
  repo_revision: str
  completed_files: int
  total_files: int
  downloaded_bytes: int
  downloaded_bytes_this_session: int
  total_bytes: int
  overall_speed: float
  overall_eta: float  # seconds
  file_progress: Dict[str, RepoFileProgressEvent] = field(default_factory=dict)
  status: str = "not_started"  # "not_started" | "in_progress" | "complete"

  def to_dict(self) -> dict:
    return {
      "shard": self.shard.to_dict(), "repo_id": self.repo_id, "repo_revision": self.repo_revision,
      "completed_files": self.completed_files, "total_files": self.total_files, "downloaded_bytes": self.downloaded_bytes,
      "downloaded_bytes_this_session": self.downloaded_bytes_this_session, "total_bytes": self.total_bytes,
      "overall_speed": self.overall_speed, "overall_eta": self.overall_eta,
      "file_progress": {k: v.to_dict() for k, v in self.file_progress.items()}, "status": self.status,
    }

  @classmethod
  def from_dict(cls, data: dict) -> "RepoProgressEvent":
    data = dict(data)
    data["shard"] = Shard.from_dict(data["shard"])
    data["file_progress"] = {k: RepoFileProgressEvent.from_dict(v) for k, v in data.get("file_progress", {}).items()}
    return cls(**data)

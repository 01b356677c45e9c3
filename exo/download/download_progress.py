"""Download progress: the events ring peers and the API carry (their exact keys are upstream exo's wire format, so an
upstream node rebuilds them), and DownloadProgress, which counts one download's bytes as they arrive."""
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Callable, Deque, Dict, Optional, Tuple

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


SPEED_WINDOW_S = 5.0  # speeds are the bytes of the last few seconds, so a stall shows at once and a burst does not last


class _Rate:
  """Bytes per second over the last SPEED_WINDOW_S, from (time, bytes so far) samples."""

  def __init__(self):
    self.samples: Deque[Tuple[float, int]] = deque()

  def sample(self, now: float, total: int) -> float:
    self.samples.append((now, total))
    while len(self.samples) > 2 and now - self.samples[1][0] >= SPEED_WINDOW_S:
      self.samples.popleft()
    then, before = self.samples[0]
    return (total - before) / (now - then) if now > then else 0.0


class _FileState:
  def __init__(self, size: int, on_disk: int):
    self.size, self.on_disk, self.this_session, self.done = size, on_disk, 0, on_disk >= size
    self.started: Optional[float] = None  # unix time of its first byte this session
    self.rate = _Rate()


def _eta(remaining: int, speed: float) -> float:
  return remaining / speed if speed > 0 and remaining > 0 else 0.0


class DownloadProgress:
  """One shard's download while its bytes arrive: for each file and in all, what is on disk, what came this session,
  the speed and the time left. `event(status)` is a snapshot in the shape ring peers and /v1/download/progress
  carry. The clocks are parameters so that tests can drive them."""

  def __init__(self, shard: Shard, repo_id: str, revision: str, sizes: Dict[str, int], on_disk: Dict[str, int],
               clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
    self.shard, self.repo_id, self.revision = shard, repo_id, revision
    self.files = {path: _FileState(size, on_disk.get(path, 0)) for path, size in sizes.items()}
    self.clock, self.wall_clock = clock, wall_clock
    self.rate = _Rate()
    self.sources: Dict[str, object] = {}  # path -> the hub.Source its bytes come from now (not in the events: upstream's format)

  def add(self, path: str, n: int) -> None:
    """n bytes of `path` arrived (n < 0: that many were thrown away, the file starts again)."""
    state = self.files[path]
    if state.started is None:
      state.started = self.wall_clock()
    state.on_disk += n
    state.this_session = max(0, state.this_session + n)

  def finish(self, path: str) -> None:
    """`path` is on disk and verified."""
    state = self.files[path]
    state.on_disk, state.done = state.size, True

  @property
  def downloaded(self) -> int:
    return sum(s.on_disk for s in self.files.values())

  @property
  def total(self) -> int:
    return sum(s.size for s in self.files.values())

  def event(self, status: str) -> RepoProgressEvent:
    now = self.clock()
    files = {}
    for path, s in self.files.items():
      speed = s.rate.sample(now, s.this_session)
      state = "complete" if s.done else "in_progress" if s.started is not None else "not_started"
      files[path] = RepoFileProgressEvent(self.repo_id, self.revision, path, s.on_disk, s.this_session, s.size, speed,
                                          _eta(s.size - s.on_disk, speed), state, s.started or 0.0)
    speed = self.rate.sample(now, sum(s.this_session for s in self.files.values()))
    return RepoProgressEvent(self.shard, self.repo_id, self.revision, sum(s.done for s in self.files.values()), len(self.files), self.downloaded,
                             sum(s.this_session for s in self.files.values()), self.total, speed, _eta(self.total - self.downloaded, speed), files, status)

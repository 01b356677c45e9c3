"""Small utilities shared across exo: log levels, callback fan-out, node id and port bookkeeping."""
import asyncio
import random
import socket
import tempfile
import uuid
from pathlib import Path
from typing import Callable, Dict, Generic, List, Optional, Tuple, TypeVar

from exo import settings

VERSION = "0.0.1"
DEBUG = settings.env_int("DEBUG")
DEBUG_DISCOVERY = settings.env_int("DEBUG_DISCOVERY")

T = TypeVar("T")
K = TypeVar("K")


class AsyncCallback(Generic[T]):
  """Latest-value cell: observers see every value synchronously, waiters see the latest one."""

  def __init__(self) -> None:
    self.condition = asyncio.Condition()
    self.result: Optional[Tuple[T, ...]] = None
    self.observers: List[Callable[..., None]] = []
    self.waiting = 0  # callers inside wait()

  async def wait(self, check_condition: Callable[..., bool], timeout: Optional[float] = None) -> Tuple[T, ...]:
    self.waiting += 1
    try:
      async with self.condition:
        await asyncio.wait_for(self.condition.wait_for(lambda: self.result is not None and check_condition(*self.result)), timeout)
        assert self.result is not None
        return self.result
    finally:
      self.waiting -= 1

  def on_next(self, callback: Callable[..., None]) -> None:
    self.observers.append(callback)

  def set(self, *args: T) -> None:
    self.result = args
    for observer in self.observers:
      observer(*args)
    if self.waiting:  # a task per call would cost every token of every stream a task per registered callback
      asyncio.create_task(self._notify())

  async def _notify(self) -> None:
    async with self.condition:
      self.condition.notify_all()


class AsyncCallbackSystem(Generic[K, T]):
  """Named callbacks; trigger_all fires every one in registration order."""

  def __init__(self) -> None:
    self.callbacks: Dict[K, AsyncCallback[T]] = {}

  def register(self, name: K) -> AsyncCallback[T]:
    if name not in self.callbacks:
      self.callbacks[name] = AsyncCallback[T]()
    return self.callbacks[name]

  def deregister(self, name: K) -> None:
    self.callbacks.pop(name, None)

  def trigger(self, name: K, *args: T) -> None:
    if name in self.callbacks:
      self.callbacks[name].set(*args)

  def trigger_all(self, *args: T) -> None:
    for callback in list(self.callbacks.values()):
      callback.set(*args)


def get_or_create_node_id() -> str:
  """A UUID persisted in <tmp>/.exo_node_id so a restarted node keeps its identity."""
  path = Path(tempfile.gettempdir()) / ".exo_node_id"
  try:
    existing = path.read_text().strip()
    uuid.UUID(existing)
    return existing
  except (OSError, ValueError):
    node_id = str(uuid.uuid4())
    try:
      path.write_text(node_id)
    except OSError:
      pass
    return node_id


def find_available_port(host: str = "", min_port: int = 49152, max_port: int = 65535) -> int:
  """A free TCP port, avoiding the last 20 picks recorded in <tmp>/exo_used_ports."""
  used_file = Path(tempfile.gettempdir()) / "exo_used_ports"
  try:
    used = [int(line) for line in used_file.read_text().split() if line.strip().isdigit()]
  except OSError:
    used = []
  for _ in range(1000):
    port = random.randint(min_port, max_port)
    if port in used:
      continue
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      try:
        s.bind((host, port))
      except OSError:
        continue
    try:
      used_file.write_text("\n".join(str(p) for p in (used + [port])[-20:]))
    except OSError:
      pass
    return port
  raise RuntimeError("No available ports in the specified range")


def pretty_print_bytes(size_in_bytes: float) -> str:
  for unit, scale in (("TB", 1024**4), ("GB", 1024**3), ("MB", 1024**2), ("KB", 1024)):
    if size_in_bytes >= scale:
      return f"{size_in_bytes / scale:.2f} {unit}"
  return f"{size_in_bytes} B"


def exo_home() -> Path:
  return Path(settings.env("EXO_HOME", Path.home() / ".cache" / "exo"))


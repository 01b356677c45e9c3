"""How long a node keeps an idle model loaded (its chat models and its embedding models alike): each resident model is
kept while requests use it and unloaded once it has been idle for its keep-alive (Ollama's: five minutes unless the
node or a request says otherwise; 0 unloads it as soon as its requests end; forever is math.inf).

Time is `clock()` (monotonic seconds; tests set a fake one); `sweep()` unloads what has expired, and a timer on the
event loop calls it when the next keep-alive runs out."""
import asyncio
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

DEFAULT_KEEP_ALIVE_S = 300.0  # as Ollama's


@dataclass
class Resident:
  loaded_at: float
  last_used: float
  keep_alive: float
  in_use: int = 0
  uses: int = 0  # which use of any model its latest was (the order of uses, whatever the clock says)

  @property
  def expires_at(self) -> float:
    """When it is unloaded if nothing uses it meanwhile (inf: never; while requests use it, their last end plus keep-alive)."""
    return self.last_used + self.keep_alive

  def times(self, now: float) -> dict:
    """Seconds loaded, and seconds until unloaded (None: never, or in use)."""
    return {"loaded_s": now - self.loaded_at,
            "expires_in_s": None if self.in_use or not math.isfinite(self.expires_at) else max(0.0, self.expires_at - now)}


def wall_times(row: dict) -> Tuple[float, Optional[float]]:
  """(loaded at, expires at) as Unix times, from a described model's seconds loaded and until unloaded (None: never,
  or in use)."""
  now = time.time()
  expires_in = row["expires_in_s"]
  return now - row["loaded_s"], None if expires_in is None or expires_in > 1e9 else now + expires_in


class KeepAlive:
  """The resident models by key; `unload(key)` is called for each one whose keep-alive runs out while idle."""

  def __init__(self, unload: Callable[[str], None], keep_alive: float = DEFAULT_KEEP_ALIVE_S, clock: Callable[[], float] = time.monotonic):
    self.unload, self.keep_alive, self.clock = unload, keep_alive, clock
    self.residents: Dict[str, Resident] = {}
    self.timer: Optional[asyncio.TimerHandle] = None
    self.uses = 0

  def __contains__(self, key: str) -> bool:
    return key in self.residents

  def add(self, key: str) -> Resident:
    now = self.clock()
    resident = self.residents[key] = Resident(now, now, self.keep_alive)
    return resident

  def take(self, key: str) -> None:
    """A request uses the model: it is not unloaded until the request lets it go."""
    self.residents[key].in_use += 1
    self.uses += 1
    self.residents[key].uses = self.uses

  def release(self, key: str, keep_alive: Optional[float] = None) -> None:
    """A request has let the model go: it stays for `keep_alive` (the node's when None: as Ollama's, each request
    sets how long the model stays after it)."""
    resident = self.residents.get(key)
    if resident is None:
      return
    resident.in_use = max(0, resident.in_use - 1)
    resident.last_used = self.clock()
    resident.keep_alive = self.keep_alive if keep_alive is None else keep_alive
    self.sweep()

  def idle(self) -> List[str]:
    """The keys no request uses, least recently used first."""
    return sorted((k for k, r in self.residents.items() if r.in_use == 0), key=lambda k: (self.residents[k].last_used, self.residents[k].uses))

  def remove(self, key: str) -> None:
    """Unload the model now (its memory is needed for another)."""
    if self.residents.pop(key, None) is not None:
      self.unload(key)

  def sweep(self) -> List[str]:
    """Unloads every idle model whose keep-alive has run out; the keys unloaded. Then sets the timer for the next."""
    now = self.clock()
    gone = [key for key, r in self.residents.items() if r.in_use == 0 and r.expires_at <= now]
    for key in gone:
      self.remove(key)
    self._set_timer(now)
    return gone

  def _set_timer(self, now: float) -> None:
    if self.timer is not None:
      self.timer.cancel()
      self.timer = None
    due = min((r.expires_at for r in self.residents.values() if r.in_use == 0), default=math.inf)
    if math.isfinite(due):
      try:
        self.timer = asyncio.get_running_loop().call_later(max(0.0, due - now) + 0.01, self.sweep)
      except RuntimeError:  # no loop (a test sweeping by hand): the next use sweeps
        pass

  def close(self) -> None:
    if self.timer is not None:
      self.timer.cancel()
    self.residents.clear()


class KeptPool:
  """A pool of models a KeepAlive keeps (`self.residents`): the node's keep-alive and the clock, read and set on it."""
  residents: KeepAlive

  @property
  def keep_alive(self) -> float:
    return self.residents.keep_alive

  @keep_alive.setter
  def keep_alive(self, seconds: float) -> None:
    self.residents.keep_alive = seconds

  @property
  def clock(self) -> Callable[[], float]:
    return self.residents.clock

  @clock.setter
  def clock(self, clock: Callable[[], float]) -> None:
    self.residents.clock = clock

from abc import ABC, abstractmethod
from typing import List

from exo.networking.peer_handle import PeerHandle


class Discovery(ABC):
  @abstractmethod
  async def start(self) -> None:
    ...

  @abstractmethod
  async def stop(self) -> None:
    ...

  @abstractmethod
  async def discover_peers(self, wait_for_peers: int = 0) -> List[PeerHandle]:
    ...


class NoDiscovery(Discovery):
  """A ring of one: no peers, no network traffic (used by `exo run` on a single node)."""

  async def start(self) -> None:
    pass

  async def stop(self) -> None:
    pass

  async def discover_peers(self, wait_for_peers: int = 0) -> List[PeerHandle]:
    return []

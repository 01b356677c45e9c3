from abc import ABC, abstractmethod
from typing import List, Optional

import numpy as np

from exo.inference.shard import Shard
from exo.topology.device_capabilities import DeviceCapabilities
from exo.topology.topology import Topology


class PeerHandle(ABC):
  @abstractmethod
  def id(self) -> str:
    ...

  @abstractmethod
  def addr(self) -> str:
    ...

  @abstractmethod
  def description(self) -> str:
    ...

  @abstractmethod
  def device_capabilities(self) -> DeviceCapabilities:
    ...

  @abstractmethod
  async def connect(self) -> None:
    ...

  @abstractmethod
  async def is_connected(self) -> bool:
    ...

  @abstractmethod
  async def disconnect(self) -> None:
    ...

  @abstractmethod
  async def health_check(self) -> bool:
    ...

  @abstractmethod
  async def send_prompt(self, shard: Shard, prompt: str, request_id: Optional[str] = None, inference_state: Optional[dict] = None) -> Optional[np.ndarray]:
    ...

  @abstractmethod
  async def send_tensor(self, shard: Shard, tensor: np.ndarray, request_id: Optional[str] = None, inference_state: Optional[dict] = None) -> Optional[np.ndarray]:
    ...

  @abstractmethod
  async def send_result(self, request_id: str, result: List[int], is_finished: bool) -> None:
    ...

  @abstractmethod
  async def send_opaque_status(self, request_id: str, status: str) -> None:
    ...

  @abstractmethod
  async def collect_topology(self, visited: set, max_depth: int) -> Topology:
    ...

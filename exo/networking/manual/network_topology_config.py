"""The manual discovery config file: every node of the cluster, where to reach it and what it offers."""
from typing import Dict

from pydantic import BaseModel, ValidationError

from exo.topology.device_capabilities import DeviceCapabilities


class PeerConfig(BaseModel):
  address: str
  port: int
  device_capabilities: DeviceCapabilities


class NetworkTopology(BaseModel):
  peers: Dict[str, PeerConfig]

  @classmethod
  def from_path(cls, path: str) -> "NetworkTopology":
    try:
      with open(path) as f:
        contents = f.read()
    except FileNotFoundError as e:
      raise FileNotFoundError(f"Config file not found at {path}") from e
    try:
      return cls.model_validate_json(contents)
    except ValidationError as e:
      raise ValueError(f"Error validating network topology config from {path}: {e}") from e

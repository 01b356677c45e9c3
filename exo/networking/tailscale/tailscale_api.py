"""A small client of Tailscale's HTTP API (v2): the device list of a tailnet and per-device custom attributes,
which is where exo nodes publish their id, gRPC port and capabilities to each other."""
import asyncio
import json
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

import aiohttp

DEFAULT_BASE_URL = "https://api.tailscale.com"
REQUEST_TIMEOUT_S = 10


class TailscaleAPI:
  def __init__(self, api_key: str, base_url: str = DEFAULT_BASE_URL):
    self.api_key = api_key
    self.base_url = base_url.rstrip("/")
    self._session: Optional[aiohttp.ClientSession] = None

  def _client(self) -> aiohttp.ClientSession:
    if self._session is None or self._session.closed:
      self._session = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self.api_key}"},
                                            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
    return self._session

  async def close(self) -> None:
    if self._session is not None:
      await self._session.close()
      self._session = None

  async def _json(self, method: str, path: str, **kwargs) -> Any:
    async with self._client().request(method, f"{self.base_url}{path}", **kwargs) as response:
      text = await response.text()
      if response.status >= 400:
        raise RuntimeError(f"Tailscale API {method} {path}: HTTP {response.status}: {text[:200]}")
      return json.loads(text) if text.strip() else {}

  async def list_devices(self, tailnet: str) -> List[Dict[str, Any]]:
    return (await self._json("GET", f"/api/v2/tailnet/{tailnet}/devices")).get("devices", [])

  async def get_device_attributes(self, device_id: str) -> Dict[str, Any]:
    return (await self._json("GET", f"/api/v2/device/{device_id}/attributes")).get("attributes", {})

  async def set_device_attribute(self, device_id: str, name: str, value: str) -> None:
    await self._json("POST", f"/api/v2/device/{device_id}/attributes/{name}", json={"value": value})


async def own_device_id() -> str:
  """This machine's Tailscale node id (`tailscale status --json` → Self.ID)."""
  proc = await asyncio.create_subprocess_exec("tailscale", "status", "--json", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
  out, err = await proc.communicate()
  if proc.returncode != 0:
    raise RuntimeError(f"`tailscale status --json` failed: {err.decode(errors='replace').strip()}")
  return json.loads(out)["Self"]["ID"]


def seconds_since(timestamp: str, now: Optional[datetime] = None) -> float:
  """Age of an RFC 3339 timestamp as the API writes them (e.g. 2024-05-01T12:00:00Z); infinite if unparsable."""
  try:
    seen = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
  except (AttributeError, ValueError):
    return float("inf")
  if seen.tzinfo is None:
    seen = seen.replace(tzinfo=timezone.utc)
  return ((now or datetime.now(timezone.utc)) - seen).total_seconds()

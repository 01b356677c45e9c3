"""Local IPv4 addresses and how much a peer reached through each interface is preferred."""
import json
import logging
import platform
import socket
import subprocess
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

import psutil

from exo.logs import DISCOVERY

CONTAINER_PREFIXES = ("docker", "br-", "veth", "cni", "flannel", "calico", "weave")
VIRTUAL_PREFIXES = ("tun", "tap", "vtun", "utun", "gif", "stf", "awdl", "llw")


def local_ipv4_addresses() -> List[Tuple[str, str]]:
  """(address, interface name) for every local IPv4 address; ("localhost", "lo") when there is none."""
  found = []
  for name, addresses in psutil.net_if_addrs().items():
    for address in addresses:
      if address.family == socket.AF_INET and not address.address.startswith("0.0."):
        found.append((address.address, name))
  return found or [("localhost", "lo")]


def priority_by_name(name: str) -> Tuple[int, str]:
  if name.startswith(CONTAINER_PREFIXES) or "bridge" in name:
    return 7, "Container Virtual"
  if name.startswith("lo"):
    return 6, "Loopback"
  if name.startswith(("tb", "nx", "ten")):
    return 5, "Thunderbolt"
  if name.startswith(("eth", "en")) and not name.startswith(("en0", "en1")):
    return 4, "Ethernet"
  if name.startswith(("wlan", "wifi", "wl")) or name in ("en0", "en1"):
    return 3, "WiFi"
  if name.startswith(VIRTUAL_PREFIXES):
    return 1, "External Virtual"
  return 2, "Other"


@lru_cache(maxsize=1)
def _macos_network_profile() -> Dict[str, dict]:
  """BSD interface name -> its entry in the macOS network profile (empty elsewhere or on failure)."""
  if platform.system() != "Darwin":
    return {}
  try:
    out = subprocess.run(["system_profiler", "SPNetworkDataType", "-json"], capture_output=True, text=True, timeout=10).stdout
    return {item["interface"]: item for item in json.loads(out).get("SPNetworkDataType", []) if "interface" in item}
  except Exception as e:
    logging.getLogger(DISCOVERY).debug("Could not read the macOS network profile: %r", e)
    return {}


def _priority_from_macos_profile(name: str) -> Optional[Tuple[int, str]]:
  entry = _macos_network_profile().get(name)
  if entry is None:
    return None
  label = f"{entry.get('_name', '')} {entry.get('hardware', '')}".lower()
  kind = str(entry.get("type", "")).lower()
  if "thunderbolt" in label:
    return 5, "Thunderbolt"
  if kind == "ethernet" or "ethernet" in label:
    return 4, "Ethernet [USB]" if "usb" in label else "Ethernet"
  if kind in ("airport", "wi-fi") or "wi-fi" in label or "airport" in label:
    return 3, "WiFi"
  if kind == "vpn" or "vpn" in label:
    return 1, "External Virtual"
  return None


def interface_priority_and_type(name: str) -> Tuple[int, str]:
  """(priority, interface_type); higher priority wins when a peer is seen through several interfaces."""
  return _priority_from_macos_profile(name) or priority_by_name(name)

"""The HTTP API's limits and access rules, read once at start-up; a flag wins over its environment variable.

  EXO_MAX_CONCURRENT_REQUESTS / --max-concurrent-requests  requests this node's API serves at once
  EXO_MAX_QUEUED_REQUESTS / --max-queued-requests          more that may wait for a place; beyond them, 429
  EXO_KV_BUDGET_MB / --kv-budget-mb                        KV cache the running requests may claim between them
  EXO_MAX_REQUEST_BODY_MB / --max-request-body-mb          largest request body
  EXO_ALLOWED_ORIGINS / --allowed-origins                  web origins, besides the node's own, whose pages may use the API
  EXO_API_KEY / --api-key                                  when set, API calls must bring it as `Authorization: Bearer <key>`
  EXO_KEEP_ALIVE                                           how long an idle embedding model stays loaded (Ollama's OLLAMA_KEEP_ALIVE:
                                                           seconds or a duration such as "5m"; negative: always)"""
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Tuple

import psutil

from exo import settings
from exo.api.embedding_request import parse_duration
from exo.embeddings.pool import DEFAULT_KEEP_ALIVE_S

DEFAULT_MAX_RUNNING = 256  # vLLM's default for requests in flight; the KV budget usually binds first
DEFAULT_MAX_QUEUED = 1024
DEFAULT_MAX_BODY_MB = 8.0  # a 128k-token prompt is well under 1 MB of JSON; 100 MB (upstream) lets one client stall a node
KV_BUDGET_SHARE = 0.5  # of the memory available when the node starts: the rest is for weights, activations, the system


def default_kv_budget() -> int:
  return int(psutil.virtual_memory().available * KV_BUDGET_SHARE)


@dataclass(frozen=True)
class ApiSettings:
  max_running: int = DEFAULT_MAX_RUNNING
  max_queued: int = DEFAULT_MAX_QUEUED
  kv_budget_bytes: int = field(default_factory=default_kv_budget)
  max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)
  allowed_origins: Tuple[str, ...] = ()  # exact origins, fnmatch patterns ("http://*.lan:*"), or "*" for any
  api_key: Optional[str] = None
  keep_alive_s: float = DEFAULT_KEEP_ALIVE_S

  def describe(self) -> str:
    origins = ", ".join(self.allowed_origins) if self.allowed_origins else "none"
    return (f"API: up to {self.max_running} requests at once and {self.max_queued} waiting, KV budget {self.kv_budget_bytes / 2**20:,.0f} MiB, "
            f"bodies up to {self.max_body_bytes / 2**20:g} MiB, web origins besides the node's own: {origins}, "
            f"API key {'required' if self.api_key else 'off'}")


def _raw(args, environ: Mapping[str, str], name: str) -> Tuple[Optional[str], str]:
  value, source = settings.given(args, environ, name)
  return (None if value is None else str(value)), source


def _number(args, environ: Mapping[str, str], name: str, low: float, integer: bool = True) -> Optional[float]:
  """The setting's value, or None when it is not set."""
  what = f"{'an integer' if integer else 'a number'} >= {low:g}"
  return settings.number(args, environ, name, low, math.inf, what, integer)[0]


def api_settings_from(args, environ: Mapping[str, str]) -> ApiSettings:
  """Raises ValueError (one line naming the setting) on a bad value."""
  def number(name, default, low, integer=True):
    value = _number(args, environ, name, low, integer)
    return default if value is None else value
  origins, _ = _raw(args, environ, "allowed_origins")
  key, _ = _raw(args, environ, "api_key")
  kv_mb = _number(args, environ, "kv_budget_mb", 1, integer=False)
  keep_alive, _ = _raw(args, environ, "EXO_KEEP_ALIVE")
  try:
    keep_alive_s = DEFAULT_KEEP_ALIVE_S if keep_alive is None else parse_duration(keep_alive)
  except ValueError as e:
    raise ValueError(f"EXO_KEEP_ALIVE {e}") from None
  return ApiSettings(
    max_running=int(number("max_concurrent_requests", DEFAULT_MAX_RUNNING, 1)),
    max_queued=int(number("max_queued_requests", DEFAULT_MAX_QUEUED, 0)),
    kv_budget_bytes=default_kv_budget() if kv_mb is None else int(kv_mb * 2**20),
    max_body_bytes=int(number("max_request_body_mb", DEFAULT_MAX_BODY_MB, 0.001, integer=False) * 2**20),
    allowed_origins=tuple(o.strip().rstrip("/") for o in (origins or "").split(",") if o.strip()),
    api_key=key.strip() if key else None,
    keep_alive_s=keep_alive_s,
  )

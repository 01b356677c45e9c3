"""Who may use the API, and from which web pages.

Any web page a user opens can send requests to a node on their network, and the browser names that page's origin
in the Origin header. So a request that changes something (every POST and DELETE: chat, token encode, quit,
delete, download) is refused with 403 when its Origin is neither the node's own (http or https on the API's port,
at localhost, the machine's host name or any of its addresses) nor allowed by EXO_ALLOWED_ORIGINS. Requests
without an Origin come from programs (curl, SDKs), not from pages. A POST must be sent as application/json: a page
can send that cross-site only after a CORS preflight, so a "simple" text/plain or form post never reaches a handler
(415). CORS headers go to allowed origins only, and never allow credentials. With an API key set, everything but
the tinychat files and the health checks needs `Authorization: Bearer <key>` or, as Anthropic's clients send it,
`x-api-key: <key>` (401 otherwise)."""
import fnmatch
import hmac
import socket
from typing import Iterable, Optional, Set
from urllib.parse import urlsplit

import psutil
from aiohttp import web

from exo.api.errors import ApiError

CHANGING_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
# Response headers a browser shows scripts without being told (CORS "safelisted"); the rest are exposed explicitly.
SAFELISTED_HEADERS = {"cache-control", "content-language", "content-length", "content-type", "expires", "last-modified", "pragma"}
DEFAULT_PORTS = {"http": 80, "https": 443}


def own_hosts() -> Set[str]:
  """The names and addresses this machine answers to (no DNS lookups: this runs on the event loop)."""
  hosts = {"localhost", "127.0.0.1", "::1"}
  name = socket.gethostname().lower()
  hosts |= {name, f"{name}.local"}
  for addresses in psutil.net_if_addrs().values():
    hosts |= {a.address.split("%")[0].lower() for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6)}
  return hosts


class Access:
  def __init__(self, allowed_origins: Iterable[str] = (), api_key: Optional[str] = None):
    self.patterns = [o.lower() for o in allowed_origins]
    self.api_key = api_key
    self.port: Optional[int] = None  # the API's port, once it listens
    self._hosts = own_hosts()

  def is_own(self, origin: str) -> bool:
    try:
      parts = urlsplit(origin)
      port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
      return False
    if parts.scheme not in DEFAULT_PORTS or port != self.port or not parts.hostname:
      return False
    if parts.hostname not in self._hosts:
      self._hosts = own_hosts()  # an address may have come up since the last look
    return parts.hostname in self._hosts

  def origin_allowed(self, origin: str) -> bool:
    origin = origin.lower().rstrip("/")
    return any(p == "*" or fnmatch.fnmatchcase(origin, p) for p in self.patterns) or self.is_own(origin)

  def check(self, request: web.Request, public: bool) -> None:
    """Raises ApiError when the request may not go on: no key (401), a foreign page (403), not JSON (415)."""
    if self.api_key and not public and request.method != "OPTIONS" and not self._has_key(request):
      raise ApiError(401, "this node needs an API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>' (the node's --api-key / "
                          "EXO_API_KEY)", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    if request.method not in CHANGING_METHODS:
      return
    origin = request.headers.get("Origin")
    if origin is not None and not self.origin_allowed(origin):
      raise ApiError(403, f"requests from web pages at {origin} may not use this node; its operator can allow them with "
                          f"EXO_ALLOWED_ORIGINS (or --allowed-origins)", code="origin_not_allowed")
    if request.method == "POST" and request.content_type != "application/json":
      raise ApiError(415, f"the body must be JSON sent as Content-Type: application/json, not {request.content_type}", param="Content-Type",
                     code="unsupported_media_type")

  def _has_key(self, request: web.Request) -> bool:
    scheme, _, bearer = request.headers.get("Authorization", "").partition(" ")
    given = [bearer.strip()] if scheme.lower() == "bearer" else []
    given += [request.headers["x-api-key"].strip()] if "x-api-key" in request.headers else []
    return any(hmac.compare_digest(key.encode(), self.api_key.encode()) for key in given)

  def add_cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
    origin = request.headers.get("Origin")
    if origin is None or not self.origin_allowed(origin):
      return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers.add("Vary", "Origin")
    exposed = [h for h in response.headers if h.lower() not in SAFELISTED_HEADERS and not h.lower().startswith("access-control-")]
    if exposed:
      response.headers["Access-Control-Expose-Headers"] = ",".join(dict.fromkeys(exposed))

  def preflight(self, request: web.Request) -> web.Response:
    """The answer to a CORS preflight: what an allowed page may send here (the route's own methods only)."""
    origin = request.headers.get("Origin")
    if origin is None or not self.origin_allowed(origin):
      raise ApiError(403, f"web pages at {origin} may not use this node (EXO_ALLOWED_ORIGINS)", code="origin_not_allowed")
    methods = sorted({r.method for r in request.match_info.route.resource} - {"OPTIONS"})
    headers = {"Access-Control-Allow-Methods": ", ".join(methods), "Access-Control-Max-Age": "600"}
    if "Access-Control-Request-Headers" in request.headers:
      headers["Access-Control-Allow-Headers"] = request.headers["Access-Control-Request-Headers"]
    return web.Response(status=204, headers=headers)

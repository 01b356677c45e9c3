"""The node's inbox of opaque statuses: each one parsed and checked once (statuses.parse), then handed to its kind's
handlers. Peer handlers act on what other nodes say (never on this node's own statuses) and may drop a status by
returning False; observers see every status of their kind, this node's own included."""
import logging
from typing import Callable, Dict, List, Optional, Tuple

from exo.orchestration import statuses

log = logging.getLogger(__name__)

# (request id, the checked status, the sender's address or None for this node) -> False to drop it
Handler = Callable[[str, statuses.Status, Optional[str]], Optional[bool]]


class Inbox:
  def __init__(self) -> None:
    self._peer: Dict[str, List[Handler]] = {}
    self._observers: Dict[str, List[Handler]] = {}

  def on_peer(self, kind: str, handler: Handler) -> None:
    self._peer.setdefault(kind, []).append(handler)

  def observe(self, kind: str, handler: Handler) -> None:
    self._observers.setdefault(kind, []).append(handler)

  def from_peer(self, request_id: str, raw: str, sender_host: Optional[str]) -> bool:
    """A status a peer sent. False if it was invalid or dropped."""
    parsed = self._parse(raw, sender_host)
    if parsed is None:
      return False
    kind, status = parsed
    for handler in self._peer.get(kind, ()):
      if handler(request_id, status, sender_host) is False:
        return False
    self._notify(kind, request_id, status, sender_host)
    return True

  def from_self(self, request_id: str, raw: str, quiet: bool = False) -> None:
    """A status this node sent (or one handed to the built-in observer): observers only."""
    parsed = self._parse(raw, None, quiet)
    if parsed is not None:
      self._notify(parsed[0], request_id, parsed[1], None)

  def _notify(self, kind: str, request_id: str, status: statuses.Status, sender_host: Optional[str]) -> None:
    for handler in self._observers.get(kind, ()):
      handler(request_id, status, sender_host)

  @staticmethod
  def _parse(raw: str, sender_host: Optional[str], quiet: bool = False) -> Optional[Tuple[Optional[str], statuses.Status]]:
    try:
      return statuses.parse(raw)
    except statuses.InvalidStatus as e:
      if not quiet:
        log.warning("exo: dropped an invalid status from %s: %s", sender_host or "a peer", e)
      return None

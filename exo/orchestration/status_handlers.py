"""What the node does with the statuses it hears about requests (parameters, ends, logprobs sent ahead of a token)
and peers (who is working, download progress, engines and grammar engines). Other kinds belong to the parts that act
on them."""
import logging
from typing import Optional, Union

from exo.download.download_progress import RepoProgressEvent
from exo.logs import VERBOSE
from exo.orchestration import statuses
from exo.orchestration.requests import Status

log = logging.getLogger(__name__)

PEER_LOGPROBS_AHEAD = 64  # a token's logprobs may arrive at most this many tokens before the token itself


class StatusHandlers:
  def __init__(self, node):
    self.node = node
    inbox = node.inbox
    inbox.on_peer(statuses.REQUEST_PARAMS, self._heard_params)
    inbox.on_peer(statuses.TOKEN_LOGPROBS, self._heard_logprobs)
    for kind in statuses.REQUEST_ENDS:
      inbox.on_peer(kind, self._heard_end)
    inbox.observe(statuses.NODE_STATUS, self._heard_node_status)
    inbox.observe(statuses.DOWNLOAD_PROGRESS, self._heard_download_progress)
    inbox.observe(statuses.SUPPORTED_ENGINES, self._heard_engines)
    inbox.observe(statuses.STRUCTURED_OUTPUT, self._heard_grammar_engine)
    if node.topology_viz:
      for kind in (statuses.NODE_STATUS, statuses.REQUEST_ERROR, statuses.DOWNLOAD_PROGRESS):
        inbox.observe(kind, lambda request_id, status, host: node.topology_viz.update_status(status.model_dump()))

  def _heard_params(self, request_id: str, status: statuses.RequestParams, sender_host: Optional[str]) -> None:
    request = self.node.lifecycle.open_request(status.request_id)
    if request is not None and request.model is None:  # parameters can no longer change once it runs here
      request.params, request.origin = status.params, status.origin

  def _heard_end(self, request_id: str, status: Union[statuses.CancelRequest, statuses.RequestError], sender_host: Optional[str]) -> Optional[bool]:
    cancel, request = status.type == statuses.CANCEL_REQUEST, self.node.requests.get(status.request_id)
    if request is not None and sender_host is not None and not self.node.on_path(request, sender_host, origin_only=cancel):
      log.warning("exo: dropped a %s for %s from %s, which is not its origin or on its path", status.type, status.request_id, sender_host)
      return False
    if request is None:
      self.node.requests.end(status.request_id, Status.FAILED)  # not seen here yet: a late hop must not start it
    else:
      self.node.lifecycle.end_request(status.request_id, Status.CANCELLED if cancel else Status.FAILED, None if cancel else status.error)
    return None

  def _heard_logprobs(self, request_id: str, status: statuses.TokenLogprobsStatus, sender_host: Optional[str]) -> None:
    """Keep a token's logprobs until the token arrives (ours, asked for, from its path, at most PEER_LOGPROBS_AHEAD ahead)."""
    request, position = self.node.requests.get(status.request_id), status.position
    if (request is None or request.origin != self.node.id or request.params.logprobs is None or len(status.top) > request.params.logprobs
        or not 0 <= position - request.delivered_here().received < PEER_LOGPROBS_AHEAD
        or (sender_host is not None and not self.node.on_path(request, sender_host))):
      log.log(VERBOSE, "Ignoring token logprobs for %s (position %s) from %s", status.request_id, position, sender_host)
      return
    request.delivered_here().logprobs_ahead[position] = status.logprobs

  def _heard_node_status(self, request_id: str, status: statuses.NodeStatus, sender_host: Optional[str]) -> None:
    if status.status.startswith("start_"):
      self.node.topology.active_node_id = status.node_id
      if status.status == "start_process_prompt" and status.node_id != self.node.id and self.node.partitioning_strategy:
        self.node.spawn(self.node.placements.preload(status.shard))
    elif status.status.startswith("end_") and status.node_id == self.node.topology.active_node_id:
      self.node.topology.active_node_id = None

  def _heard_download_progress(self, request_id: str, status: statuses.DownloadProgress, sender_host: Optional[str]) -> None:
    if status.node_id in {self.node.id, *self.node.peer_hosts}:
      try:
        self.node.node_download_progress[status.node_id] = RepoProgressEvent.from_dict(status.progress)
        self.node.node_download_sources[status.node_id] = status.sources
      except (KeyError, TypeError, ValueError) as e:
        log.log(VERBOSE, "Ignoring malformed download progress: %r", e)

  def _heard_engines(self, request_id: str, status: statuses.SupportedEngines, sender_host: Optional[str]) -> None:
    if status.node_id in self.node.peer_hosts:
      self.node.peer_engines[status.node_id] = status.engines

  def _heard_grammar_engine(self, request_id: str, status: statuses.StructuredOutput, sender_host: Optional[str]) -> None:
    if status.node_id in self.node.peer_hosts:
      self.node.peer_grammar_engines[status.node_id] = status.engine

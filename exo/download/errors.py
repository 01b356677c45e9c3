"""Why a model's files could not be made complete on a node, in words its user can act on.

A failure has a kind (what went wrong), the HTTP status the API answers with, and a detail (what exactly happened).
The kinds are fixed: clients read the kind as the error's `code`. Every status is a 5xx other than 500, since none
of these is the request's fault: 502 when the hub answered badly or not at all, 504 when it did not answer in
time, 507 when this node's disk is full, 503 when the node is offline (HF_HUB_OFFLINE=1) and lacks the files."""
import re
from typing import Optional

# kind -> (HTTP status, the label that starts the cause in messages)
KINDS = {
  "hub_unreachable": (502, "hub unreachable"),
  "hub_timeout": (504, "hub timed out"),
  "repo_not_found": (502, "repository not found"),
  "file_not_found": (502, "file not found"),
  "gated": (502, "gated repository"),
  "corrupt": (502, "bytes differ from what the hub announced"),
  "disk_full": (507, "disk full"),
  "offline": (503, "offline and not on disk"),
}
_KIND_OF_LABEL = {label: kind for kind, (_, label) in KINDS.items()}
_MESSAGE = re.compile(r"^Could not download model (?P<model>\S+) \(repository (?P<repo>\S+)(?: from (?P<endpoint>\S+))?\)"
                      r"(?: on node (?P<node>\S+))?: (?P<label>[^:]+): (?P<detail>.*)$", re.S)


class DownloadFailure(Exception):
  """What went wrong with the hub or the disk, before the model and node it happened for are known."""

  def __init__(self, kind: str, detail: str):
    assert kind in KINDS, kind
    super().__init__(f"{KINDS[kind][1]}: {detail}")
    self.kind, self.detail = kind, " ".join(detail.split())  # one line: `exo run` prints it as one


class DownloadError(Exception):
  """A model's files could not be made complete on a node. Its message names the model, the repository, where it
  came from and the cause, in a fixed form that survives the trip to another node as a request_error's text (see
  `from_message`)."""

  def __init__(self, model_id: str, repo_id: str, kind: str, detail: str, endpoint: Optional[str] = None, node_id: Optional[str] = None):
    self.model_id, self.repo_id, self.kind, self.endpoint, self.node_id = model_id, repo_id, kind, endpoint, node_id
    self.detail = " ".join(detail.split())
    where = f" from {endpoint}" if endpoint else ""
    on = f" on node {node_id}" if node_id else ""
    super().__init__(f"Could not download model {model_id} (repository {repo_id}{where}){on}: {KINDS[kind][1]}: {self.detail}")

  @classmethod
  def of(cls, failure: DownloadFailure, model_id: str, repo_id: str, endpoint: Optional[str] = None, node_id: Optional[str] = None) -> "DownloadError":
    return cls(model_id, repo_id, failure.kind, failure.detail, endpoint, node_id)

  @property
  def status(self) -> int:
    return KINDS[self.kind][0]

  @property
  def message(self) -> str:
    return str(self)

  @classmethod
  def from_message(cls, text: str) -> Optional["DownloadError"]:
    """The error again from its message, as a peer's request_error carries it (statuses carry text only); None if
    the text is not a download error's."""
    match = _MESSAGE.match(text.strip())
    if match is None or match["label"] not in _KIND_OF_LABEL:
      return None
    return cls(match["model"], match["repo"], _KIND_OF_LABEL[match["label"]], match["detail"], match["endpoint"], match["node"])

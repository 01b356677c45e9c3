"""Terminal view of a node (rich Live): the ring in partition order with each node's layers, memory and download,
where to chat, the downloads under way file by file, and the latest requests. The Node pushes updates; rich redraws
a few times a second from its own thread."""
import re
import threading
import time
from collections import OrderedDict
from typing import Dict, List, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from exo.download.download_progress import RepoProgressEvent
from exo.helpers import VERSION, pretty_print_bytes
from exo.topology.partitioning_strategy import Partition, map_partitions_to_shards
from exo.topology.topology import Topology

MAX_REQUESTS_SHOWN = 6
MAX_FILES_SHOWN = 4  # of a download under way, the files arriving now
CHAT_MARKUP = re.compile(r"<\|[^|>]*\|>|\bassistant\s*$")


class RequestView:
  def __init__(self, request_id: str, prompt: str):
    self.request_id = request_id
    self.prompt = prompt
    self.started = time.monotonic()
    self.elapsed_s: Optional[float] = None
    self.error: Optional[str] = None
    self.node_id: Optional[str] = None


class TopologyViz:
  def __init__(self, chatgpt_api_endpoints: List[str] = [], web_chat_urls: List[str] = []):
    self.chatgpt_api_endpoints = list(chatgpt_api_endpoints)
    self.web_chat_urls = list(web_chat_urls)
    self.topology = Topology()
    self.partitions: List[Partition] = []
    self.node_id: Optional[str] = None
    self.node_download_progress: Dict[str, object] = {}
    self.node_download_sources: Dict[str, Dict[str, str]] = {}  # node id -> its files arriving now -> "hub" or "peer <id>"
    self.requests: "OrderedDict[str, RequestView]" = OrderedDict()
    self.model: Optional[tuple] = None  # (model_id, n_layers) of the latest request, to show layer ranges
    self.placement: dict = {}  # the node's placement view: each model's groups and their layers, where routes are on
    self._lock = threading.Lock()  # rich renders from its refresh thread
    self.console = Console()
    self.live: Optional[Live] = None

  def start(self) -> None:
    self.live = Live(get_renderable=self.render, console=self.console, refresh_per_second=2, transient=False)
    self.live.start()

  def stop(self) -> None:
    if self.live is not None:
      self.live.stop()
      self.live = None

  # --- updates from the Node ---

  def update_visualization(self, topology: Topology, partitions: List[Partition], node_id: Optional[str] = None,
                           node_download_progress: Optional[Dict[str, object]] = None, placement: Optional[dict] = None) -> None:
    with self._lock:
      self.topology, self.partitions = topology, list(partitions)
      self.placement = dict(placement or {})
      self.node_id = node_id if node_id is not None else self.node_id
      self.node_download_progress = dict(node_download_progress or {})

  def update_status(self, status: dict) -> None:
    if not isinstance(status, dict):
      return
    request_id = status.get("request_id") or ""
    kind = status.get("type")
    with self._lock:
      if kind == "node_status" and status.get("status") == "start_process_prompt" and request_id:
        view = self.requests.get(request_id) or RequestView(request_id, str(status.get("prompt", "")))
        view.node_id = view.node_id or status.get("node_id")
        self.requests[request_id] = view
        base = status.get("base_shard") or {}
        if base.get("model_id") and base.get("n_layers"):
          self.model = (base["model_id"], int(base["n_layers"]))
        while len(self.requests) > MAX_REQUESTS_SHOWN:
          self.requests.popitem(last=False)
      elif kind == "node_status" and status.get("status") == "end_process_prompt" and request_id in self.requests:
        view = self.requests[request_id]
        if view.elapsed_s is None and "elapsed_time_ns" in status:
          view.elapsed_s = status["elapsed_time_ns"] / 1e9
      elif kind == "request_error" and request_id in self.requests:
        self.requests[request_id].error = str(status.get("error", "failed"))
      elif kind == "download_progress" and status.get("node_id") in (self.node_id, *self.topology.nodes):
        try:  # at once, not only at the next topology round; from this ring's nodes only
          self.node_download_progress[status["node_id"]] = RepoProgressEvent.from_dict(status["progress"])
          self.node_download_sources[status["node_id"]] = dict(status.get("sources") or {})
        except (KeyError, TypeError, ValueError):
          pass

  # --- drawing ---

  def render(self):
    with self._lock:
      tables = [self._groups_table()] if self.placement.get("active") and self.placement.get("models") else [self._ring_table()]
      parts = [self._header(), *tables]
      if any(getattr(p, "status", None) == "in_progress" for p in self.node_download_progress.values()):
        parts.append(self._downloads_table())
      return Panel(Group(*parts, self._requests_table()), title=f"exo {VERSION}", border_style="cyan")

  def _header(self) -> Text:
    text = Text()
    for url in self.web_chat_urls:
      text.append("Web chat: ", style="bold").append(f"{url}\n")
    for url in self.chatgpt_api_endpoints:
      text.append("ChatGPT API: ", style="bold").append(f"{url}\n")
    order = [p.node_id for p in self.partitions]
    if self.placement.get("active"):
      text.append("Placement: ", style="bold").append(f"{self.placement['mode']} (version {self.placement['version']})")
    elif order:
      text.append("Ring: ", style="bold").append(" → ".join(order + [order[0]]))
    return text

  def _groups_table(self) -> Table:
    """Each model's groups: every group serves a whole copy; its nodes hold the layers shown, first layers first."""
    table = Table(title="Groups (each serves a whole copy)", expand=True)
    for column in ("model", "group", "node", "layers", "memory", "ready"):
      table.add_column(column)
    for model, view in self.placement["models"].items():
      for i, group in enumerate(view["groups"]):
        for stage in group["stages"]:
          caps = self.topology.nodes.get(stage["node_id"])
          name = stage["node_id"] + (" (this node)" if stage["node_id"] == self.node_id else "")
          table.add_row(model, str(i), name, f"{stage['start_layer']}–{stage['end_layer']} of {view['n_layers']}",
                        f"{caps.memory / 1024:.1f} GiB" if caps else "?", "yes" if view["ready"][i] else "loading",
                        style="bold" if stage["node_id"] == self.node_id else None)
    return table

  def _ring_table(self) -> Table:
    table = Table(title="Nodes, in ring order", expand=True)
    for column in ("#", "node", "layers", "memory", "device", "download"):
      table.add_column(column)
    shards = map_partitions_to_shards(self.partitions, self.model[1], self.model[0]) if self.model else []
    for i, partition in enumerate(self.partitions):
      caps = self.topology.nodes.get(partition.node_id)
      share = f"{partition.start:.0%}–{partition.end:.0%}"
      layers = f"{shards[i].start_layer}–{shards[i].end_layer} of {self.model[1]} ({share})" if i < len(shards) else share
      name = partition.node_id + (" (this node)" if partition.node_id == self.node_id else "")
      if partition.node_id == self.topology.active_node_id:
        name += " ●"
      memory = f"{caps.memory / 1024:.1f} GiB" if caps else "?"
      device = f"{caps.chip}" if caps else "?"
      download = download_summary(self.node_download_progress.get(partition.node_id))
      table.add_row(str(i), name, layers, memory, device, download, style="bold" if partition.node_id == self.node_id else None)
    return table

  def _downloads_table(self) -> Table:
    table = Table(title="Downloads", expand=True)
    for column in ("node", "file", "progress"):
      table.add_column(column, overflow="ellipsis", no_wrap=True)
    for node_id, progress in self.node_download_progress.items():
      if getattr(progress, "status", None) != "in_progress":
        continue
      table.add_row(node_id, progress.repo_id, download_summary(progress))
      arriving = [f for f in progress.file_progress.values() if f.status == "in_progress"]
      for file in sorted(arriving, key=lambda f: -f.total)[:MAX_FILES_SHOWN]:
        source = self.node_download_sources.get(node_id, {}).get(file.file_path)
        table.add_row("", f"  {file.file_path}" + (f" from {source}" if source else ""), transfer(file.downloaded, file.total, file.speed, file.eta))
    return table

  def _requests_table(self) -> Table:
    table = Table(title="Recent requests", expand=True)
    for column in ("request", "prompt", "state"):
      table.add_column(column, overflow="ellipsis", no_wrap=True)
    for view in reversed(self.requests.values()):
      if view.error:
        state = Text(f"error: {view.error}", style="red")
      elif view.elapsed_s is not None:
        state = Text(f"prompt handled in {view.elapsed_s:.2f} s")
      else:
        state = Text(f"running {time.monotonic() - view.started:.0f} s", style="yellow")
      prompt = " ".join(CHAT_MARKUP.sub(" ", view.prompt).split())[-80:]  # the question, not the template around it
      table.add_row(view.request_id[:8], prompt, state)
    return table


def transfer(downloaded: int, total: int, speed: float, eta: float) -> str:
  """"42% · 12.00 MB / 30.00 MB · 5.10 MB/s · 4 s left"."""
  text = f"{downloaded / total:.0%} · {pretty_print_bytes(downloaded)} / {pretty_print_bytes(total)}" if total else pretty_print_bytes(downloaded)
  if speed > 0:
    text += f" · {pretty_print_bytes(int(speed))}/s"
  if eta > 0:
    text += f" · {eta:.0f} s left"
  return text


def download_summary(progress) -> str:
  """A node's latest download in a few words: under way (with speed and time left), done, or stopped part way."""
  if progress is None or not getattr(progress, "total_bytes", 0):
    return ""
  if progress.status == "complete":
    return "done"
  if progress.status == "in_progress":
    return transfer(progress.downloaded_bytes, progress.total_bytes, progress.overall_speed, progress.overall_eta)
  return f"stopped at {progress.downloaded_bytes / progress.total_bytes:.0%}"

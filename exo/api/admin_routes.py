"""The routes that are not generation: the model list and downloads, the topology and live state, health and
metrics, quit, and upstream's image routes (which this build refuses clearly)."""
import asyncio
import shutil
from contextlib import aclosing
from typing import Callable, List, Optional, Tuple

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from exo.api.downloads import downloads_view
from exo.api.errors import ApiError, BadRequest
from exo.api.event_stream import EventStream
from exo.api.replies import json_reply
from exo.api.request_fields import parse_json_body
from exo.api.serving import ServingCore
from exo.download.shard_download import repo_dir
from exo.embeddings.registry import checkpoint_path, embedding_cards
from exo.keep_alive import wall_times
from exo.models import build_base_shard, build_full_shard, get_pretty_name, get_repo, model_cards


class AdminRoutes:
  def __init__(self, core: ServingCore, is_stopping: Callable[[], bool], on_quit: Optional[Callable[[], None]]):
    self.core, self.node, self.engine_classname = core, core.node, core.engine_classname
    self.is_stopping, self.on_quit = is_stopping, on_quit

  def routes(self) -> List[Tuple[Tuple[str, ...], str, Callable]]:
    return [
      (("/v1/models", "/models"), "GET", self.handle_models),
      (("/initial_models",), "GET", self.handle_initial_models),
      (("/modelpool",), "GET", self.handle_model_pool),
      (("/v1/download/progress",), "GET", self.handle_download_progress),
      (("/v1/downloads",), "GET", self.handle_downloads),
      (("/download",), "POST", self.handle_download),
      (("/models/{model_name}",), "DELETE", self.handle_delete_model),
      (("/v1/topology", "/topology"), "GET", self.handle_topology),
      (("/healthcheck",), "GET", self.handle_healthcheck),
      (("/v1/state",), "GET", self.handle_state),
      (("/health",), "GET", self.handle_health),
      (("/metrics",), "GET", self.handle_metrics),
      (("/quit",), "POST", self.handle_quit),
      (("/v1/image/generations",), "POST", self.handle_image_generations),
      (("/create_animation",), "POST", self.handle_create_animation),
    ]

  async def _read_json(self, request: web.Request) -> dict:
    return await self.core.in_thread(parse_json_body, await request.read())

  # --- models, downloads, topology ---

  async def handle_models(self, request: web.Request) -> web.Response:
    """Every model this node can serve; those loaded now (chat and embedding) with `loaded_at` and `expires_at`
    (Unix seconds; null: kept while in use, or forever), a checkpoint served by path among them."""
    loaded = {held["model"]: held for held in self.node.model_pool.describe() + self.core.embeddings.pool.describe()}
    chat = [{"id": m, "object": "model", "owned_by": "exo", "ready": True} for m in [*model_cards, *(m for m in loaded if m not in model_cards and m not in embedding_cards)]]
    embedding = [{"id": m, "object": "model", "owned_by": "exo", "ready": checkpoint_path(m) is not None, "type": "embedding"} for m in embedding_cards]
    for entry in chat + embedding:
      if entry["id"] in loaded:
        loaded_at, expires_at = wall_times(loaded[entry["id"]])
        entry.update(loaded_at=int(loaded_at), expires_at=None if expires_at is None else int(expires_at))
    return json_reply({"object": "list", "data": chat + embedding})

  async def handle_initial_models(self, request: web.Request) -> web.Response:
    return json_reply({
      m: {"name": get_pretty_name(m) or m, "downloaded": None, "download_percentage": None, "total_size": None, "total_downloaded": None, "loading": True}
      for m in model_cards if get_repo(m, self.engine_classname) is not None})

  async def handle_model_pool(self, request: web.Request) -> web.StreamResponse:
    """SSE: one event per model this engine can run, saying how much of it is on disk; then [DONE]."""
    stream = EventStream(request, {"Connection": "keep-alive"})
    try:
      async with aclosing(self.node.shard_downloader.get_shard_download_status(self.engine_classname)) as statuses:
        async for _, event in statuses:
          complete = event.status == "complete"
          percentage = 100 if complete else (event.downloaded_bytes / event.total_bytes * 100 if event.total_bytes else 0.0)
          await stream.send({event.shard.model_id: {"downloaded": complete, "download_percentage": percentage, "total_size": event.total_bytes,
                                                    "total_downloaded": event.downloaded_bytes}})
      await stream.send("[DONE]")
    except ConnectionError:
      pass
    except Exception as e:
      self.core.log_error("Model pool status failed", e)
      if not stream.started:
        raise ApiError(500, f"Server error: {e}") from None
      await stream.send("[DONE]")  # the models that could be read were sent; the rest are skipped
    return stream.response

  async def handle_download_progress(self, request: web.Request) -> web.Response:
    return json_reply({node_id: {**event.to_dict(), "file_sources": self.node.node_download_sources.get(node_id, {})}
                       for node_id, event in self.node.node_download_progress.items() if event.status == "in_progress"})

  async def handle_downloads(self, request: web.Request) -> web.Response:
    return json_reply(downloads_view(self.node.shard_downloader))

  def _known_model(self, model, param: str) -> str:
    if not isinstance(model, str) or not model:
      raise BadRequest(f"{param} is required: a model id such as {next(iter(model_cards))!r}", param=param)
    if model not in model_cards:
      raise ApiError(404, f"Invalid model: {model}. Supported models: {list(model_cards)}", param=param, code="model_not_found")
    return model

  async def handle_download(self, request: web.Request) -> web.Response:
    model = self._known_model((await self._read_json(request)).get("model"), "model")
    shard = build_full_shard(model, self.engine_classname)
    if shard is None:
      raise BadRequest(f"Could not build shard for model {model}: it has no files for {self.engine_classname}", param="model",
                       code="model_not_supported")
    self.node.spawn(self._download(shard))
    return json_reply({"status": "success", "message": f"Download started for model: {model}"})

  async def _download(self, shard) -> None:
    try:
      await self.node.shard_downloader.ensure_shard(shard, self.engine_classname)
    except Exception as e:
      self.core.log_error(f"Download of {shard.model_id} failed", e)

  async def handle_delete_model(self, request: web.Request) -> web.Response:
    model = self._known_model(request.match_info["model_name"], "model_name")
    repo = get_repo(model, self.engine_classname)
    if repo is None:
      raise BadRequest(f"model {model} has no files for {self.engine_classname}", param="model_name", code="model_not_supported")
    path = repo_dir(repo)
    if self.node.shard_downloader.is_downloading(repo):
      raise ApiError(409, f"Model {model} is downloading; delete its files once the download has ended", param="model_name", code="download_in_progress")
    if not path.exists():
      raise ApiError(404, f"Model {model} files not found", param="model_name", code="model_files_not_found")
    try:
      await asyncio.to_thread(shutil.rmtree, path)
    except OSError as e:
      raise ApiError(500, f"Error deleting model: {e}") from None
    return json_reply({"status": "success", "message": f"Model {model} deleted successfully"})

  async def handle_topology(self, request: web.Request) -> web.Response:
    """The topology as upstream shows it, and the placement: the groups of each model (this node's default model and
    the one its engine holds) with each node's layers."""
    models = [build_base_shard(self.core.default_model, self.engine_classname), *self.node.model_pool.shards_loaded()]
    bases = list({(s.model_id, s.n_layers): s for s in models if s is not None}.values())
    return json_reply({**self.node.current_topology.to_json(), "placement": self.node.placements.to_json(bases)})

  async def handle_healthcheck(self, request: web.Request) -> web.Response:
    return json_reply({"status": "ok"})

  async def handle_state(self, request: web.Request) -> web.Response:
    """This node's live requests (id, model, status, positions, KV bytes) and its KV memory in all; the chat models
    it holds (`models`) and the embedding models loaded beside them (`embedding_models`): seconds loaded, seconds until
    unloaded, requests using each."""
    return json_reply({**self.node.state(), "embedding_models": self.core.embeddings.pool.describe()})

  async def handle_health(self, request: web.Request) -> web.Response:
    """Readiness: 200 while this node takes new requests; 503 while it is stopping or every place is taken."""
    admission = self.core.admission
    status = "stopping" if self.is_stopping() else "overloaded" if admission.full() else "ok"
    return json_reply({"status": status, "requests_running": admission.running, "requests_waiting": admission.waiting,
                       "peers": len(self.node.peers)}, 200 if status == "ok" else 503)

  async def handle_metrics(self, request: web.Request) -> web.Response:
    return web.Response(body=self.core.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

  async def handle_quit(self, request: web.Request) -> web.StreamResponse:
    response = json_reply({"detail": "Quit signal received"})
    await response.prepare(request)
    await response.write_eof()  # the client has its answer before the node goes away
    if self.on_quit is not None:
      asyncio.get_running_loop().call_soon(self.on_quit)
    return response

  # --- images (no engine of this build generates images) ---

  async def handle_image_generations(self, request: web.Request) -> web.Response:
    body = await self._read_json(request)
    # Image models (stable-diffusion) run only on upstream's MLX engine; none is in this build's registry.
    raise BadRequest(f"Unsupported model: {body.get('model')} with inference engine {self.engine_classname}", param="model",
                     code="model_not_supported")

  async def handle_create_animation(self, request: web.Request) -> web.Response:
    body = await self._read_json(request)
    if not body.get("replacement_image_path"):
      raise BadRequest("replacement_image_path is required", param="replacement_image_path")
    raise ApiError(501, "animations are rendered by the macOS app, which this build does not include", code="not_implemented")

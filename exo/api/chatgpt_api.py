"""The HTTP API every node serves: OpenAI's chat and completions, Anthropic's Messages, OpenAI's Responses and
Ollama's API (each a dialect: a parser into the serving core's request and a renderer of its events, see
docs/api-dialects.md), the admin routes, and the tinychat web page.

This module holds the server: its routes and middleware. A request passes, in order: the error middleware
(ApiError and aiohttp's own errors become the JSON error of the route's dialect), access (API key, Origin, content
type: exo/api/access.py), the response deadline, then its handler. Generation itself is the serving core's
(exo/api/serving.py)."""
import asyncio
from typing import Callable, Optional

from aiohttp import web

from exo.api import replies
from exo.api.access import Access
from exo.api.admin_routes import AdminRoutes
from exo.api.anthropic.routes import AnthropicRoutes
from exo.api.downloads import download_api_error
from exo.api.errors import ApiError
from exo.api.event_stream import STREAM_KEY
from exo.api.ollama.routes import OllamaRoutes
from exo.api.openai_responses.routes import ResponsesRoutes
from exo.api.openai_embeddings import OpenAIEmbeddingRoutes
from exo.api.openai_routes import OpenAIRoutes
from exo.api.serving import ServingCore
from exo.api.settings import ApiSettings
from exo.api.static_routes import add_static_routes, is_static
from exo.download.errors import DownloadError
from exo.download.peer_files import FILES_PREFIX

PUBLIC_PATHS = {"/healthcheck", "/health"}  # answered without the API key (load balancers, liveness probes)


class ChatGPTAPI:
  def __init__(self, node, inference_engine_classname: str, response_timeout: float = 90, on_chat_completion_request: Optional[Callable] = None,
               default_model: Optional[str] = None, system_prompt: Optional[str] = None, on_quit: Optional[Callable[[], None]] = None,
               settings: Optional[ApiSettings] = None):
    self.node = node
    self.inference_engine_classname = inference_engine_classname
    self.response_timeout = response_timeout
    self.default_model = default_model or "llama-3.2-1b"
    self.system_prompt = system_prompt
    self.on_quit = on_quit
    self.settings = settings or ApiSettings()
    self.access = Access(self.settings.allowed_origins, self.settings.api_key)
    self.core = ServingCore(node, inference_engine_classname, self.settings, response_timeout, self.default_model, system_prompt)
    self.core.on_request = on_chat_completion_request
    self.runner: Optional[web.AppRunner] = None
    self.stopping = False
    anthropic, ollama = AnthropicRoutes(self.core), OllamaRoutes(self.core)
    # Errors in the shape of the dialect whose paths they are under (OpenAI's elsewhere).
    self.error_shapes = [(prefix, dialect.error_reply) for dialect in (anthropic, ollama) for prefix in dialect.PREFIXES]
    self.app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[self._errors, self._guard, self._deadline])
    self.app.on_response_prepare.append(self._add_cors_headers)
    routes = [OpenAIRoutes(self.core), OpenAIEmbeddingRoutes(self.core), ResponsesRoutes(self.core), anthropic, ollama,
              AdminRoutes(self.core, lambda: self.stopping, on_quit)]
    for paths, method, handler in [route for dialect in routes for route in dialect.routes()]:
      for path in paths:
        self.app.router.add_route(method, path, handler)
        self.app.router.add_route("OPTIONS", path, self.handle_preflight)
    add_static_routes(self.app)

  # What upstream-style callers read and set on the API object.

  @property
  def admission(self):
    return self.core.admission

  @property
  def metrics(self):
    return self.core.metrics

  @property
  def on_chat_completion_request(self) -> Optional[Callable]:
    return self.core.on_request

  @on_chat_completion_request.setter
  def on_chat_completion_request(self, hook: Optional[Callable]) -> None:
    self.core.on_request = hook

  async def tokenizer_for(self, model_id: str):
    return (await self.core.profiles.get(model_id))[0]

  # --- server ---

  async def run(self, host: str = "0.0.0.0", port: int = 52415) -> None:
    """Start serving and return once the socket listens."""
    # handler_cancellation: a client that disconnects cancels its handler, and with it the generation in the ring.
    self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
    await self.runner.setup()
    self.access.port = port
    await web.TCPSite(self.runner, host, port).start()

  async def stop(self) -> None:
    self.stopping = True
    if self.runner is not None:
      await self.runner.cleanup()
      self.runner = None
    self.core.close()

  # --- middlewares ---

  @web.middleware
  async def _errors(self, request: web.Request, handler):
    """Every error a request meets becomes its dialect's JSON error; nothing unforeseen reaches the client as a bare 500."""
    try:
      return await handler(request)
    except ApiError as e:
      error = e
    except DownloadError as e:
      error = download_api_error(e)
    except web.HTTPException as e:
      if e.status < 400:
        raise
      error = self._http_error(request, e)
    except Exception as e:
      self.core.log_error(f"{request.method} {request.path} failed", e)
      error = ApiError(500, f"Server error (see logs with DEBUG>=2): {e!r}")
    self.core.count_error(error)
    return self._error_reply(request, error)

  def _error_reply(self, request: web.Request, error: ApiError) -> web.Response:
    reply = next((shape for prefix, shape in self.error_shapes if request.path.startswith(prefix)), replies.error_reply)
    return reply(error)

  def _http_error(self, request: web.Request, e: web.HTTPException) -> ApiError:
    if e.status == 413:
      return ApiError(413, f"the request body is larger than this node's limit of {self.settings.max_body_bytes:,} bytes "
                           f"(EXO_MAX_REQUEST_BODY_MB)", code="request_too_large")
    if e.status == 404:
      return ApiError(404, f"nothing here: {request.method} {request.path}", code="not_found")
    if e.status == 405:
      return ApiError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed", headers={"Allow": e.headers.get("Allow", "")})
    return ApiError(e.status, e.reason)

  @web.middleware
  async def _guard(self, request: web.Request, handler):
    # A node's model files answer ring members only, with or without an API key (exo/download/peer_files.py).
    self.access.check(request, public=request.path in PUBLIC_PATHS or is_static(request) or request.path.startswith(FILES_PREFIX))
    return await handler(request)

  @web.middleware
  async def _deadline(self, request: web.Request, handler):
    """Every handler runs under response_timeout: 504 if nothing was sent yet, else its stream ends with an error event."""
    try:
      async with asyncio.timeout(self.response_timeout):
        return await handler(request)
    except TimeoutError:
      error = self.core.timeout_error()
      stream = request.get(STREAM_KEY)
      if stream is None:
        raise error from None
      self.core.count_error(error)
      await stream.fail(error)
      return stream.response

  async def _add_cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
    if not is_static(request):
      self.access.add_cors_headers(request, response)

  async def handle_preflight(self, request: web.Request) -> web.Response:
    return self.access.preflight(request)

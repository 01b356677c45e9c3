"""The ChatGPT-compatible HTTP API every node serves, and the tinychat web page (see spec/http-api.md)."""
import asyncio
import shutil
import traceback
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import Callable, Dict, Optional

from aiohttp import web

from exo.api import responses
from exo.api.chat_request import BadRequest, ChatRequest, build_prompt, parse_chat_request, parse_json_object, parse_messages, resolve_model
from exo.api.reply_text import ReplyText
from exo.download.shard_download import local_model_path, repo_dir
from exo.helpers import DEBUG
from exo.inference.tokenizers import resolve_tokenizer
from exo.models import build_base_shard, build_full_shard, get_pretty_name, get_repo, model_cards
from exo.orchestration.generation import generate

TINYCHAT_DIR = Path(__file__).resolve().parent.parent / "tinychat"
IMAGES_DIR = Path.home() / "Documents" / "Exo" / "Images"
MAX_BODY_BYTES = 100 * 1024 * 1024
# Response headers a browser shows scripts without being told (CORS "safelisted"); the rest are exposed explicitly.
SAFELISTED_HEADERS = {"cache-control", "content-language", "content-length", "content-type", "expires", "last-modified", "pragma"}
# Request slot for a stream already sent, so a timeout cuts it instead of replacing it (RequestKey: aiohttp >= 3.12).
STREAM_KEY = web.RequestKey("exo_stream", web.StreamResponse) if hasattr(web, "RequestKey") else "exo_stream"


class ChatGPTAPI:
  def __init__(self, node, inference_engine_classname: str, response_timeout: float = 90, on_chat_completion_request: Optional[Callable] = None,
               default_model: Optional[str] = None, system_prompt: Optional[str] = None, on_quit: Optional[Callable[[], None]] = None):
    self.node = node
    self.inference_engine_classname = inference_engine_classname
    self.response_timeout = response_timeout
    self.on_chat_completion_request = on_chat_completion_request
    self.default_model = default_model or "llama-3.2-1b"
    self.system_prompt = system_prompt
    self.on_quit = on_quit
    self.runner: Optional[web.AppRunner] = None
    self._tokenizers: Dict[str, object] = {}
    self._tokenizer_locks: Dict[str, asyncio.Lock] = {}
    self.app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._deadline])
    self.app.on_response_prepare.append(self._add_cors_headers)
    for paths, method, handler in [
      (("/v1/chat/completions", "/chat/completions"), "POST", self.handle_chat_completions),
      (("/v1/chat/token/encode", "/chat/token/encode"), "POST", self.handle_token_encode),
      (("/v1/models", "/models"), "GET", self.handle_models),
      (("/initial_models",), "GET", self.handle_initial_models),
      (("/modelpool",), "GET", self.handle_model_pool),
      (("/v1/download/progress",), "GET", self.handle_download_progress),
      (("/download",), "POST", self.handle_download),
      (("/models/{model_name}",), "DELETE", self.handle_delete_model),
      (("/v1/topology", "/topology"), "GET", self.handle_topology),
      (("/healthcheck",), "GET", self.handle_healthcheck),
      (("/quit",), "POST", self.handle_quit),
      (("/v1/image/generations",), "POST", self.handle_image_generations),
      (("/create_animation",), "POST", self.handle_create_animation),
    ]:
      for path in paths:
        self.app.router.add_route(method, path, handler)
        self.app.router.add_route("OPTIONS", path, self.handle_preflight)
    self.app.router.add_get("/images/{file_name}", self.handle_image_file)
    self.app.router.add_get("/", self.handle_root)
    self.app.router.add_static("/", TINYCHAT_DIR, name="tinychat")  # last: it claims every path for GET

  # --- server ---

  async def run(self, host: str = "0.0.0.0", port: int = 52415) -> None:
    """Start serving and return once the socket listens."""
    # handler_cancellation: a client that disconnects cancels its handler, and with it the generation in the ring.
    self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
    await self.runner.setup()
    await web.TCPSite(self.runner, host, port).start()

  async def stop(self) -> None:
    if self.runner is not None:
      await self.runner.cleanup()
      self.runner = None

  @web.middleware
  async def _deadline(self, request: web.Request, handler):
    """Every handler runs under response_timeout: 408 if nothing was sent yet, else the stream is cut."""
    try:
      return await asyncio.wait_for(handler(request), self.response_timeout)
    except asyncio.TimeoutError:
      stream = request.get(STREAM_KEY)
      return stream if stream is not None else responses.detail(408, "Request timed out")

  def _is_static(self, request: web.Request) -> bool:
    route = request.match_info.route
    return isinstance(route.resource, web.StaticResource) or route.handler in (self.handle_root, self.handle_image_file)

  async def _add_cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
    origin = request.headers.get("Origin")
    if origin is None or self._is_static(request):
      return
    response.headers["Access-Control-Allow-Origin"] = origin
    response.headers["Access-Control-Allow-Credentials"] = "true"
    exposed = [h for h in response.headers if h.lower() not in SAFELISTED_HEADERS and not h.lower().startswith("access-control-")]
    if exposed:
      response.headers["Access-Control-Expose-Headers"] = ",".join(exposed)

  async def handle_preflight(self, request: web.Request) -> web.Response:
    headers = {}
    if "Access-Control-Request-Method" in request.headers:
      headers["Access-Control-Allow-Methods"] = request.headers["Access-Control-Request-Method"]
    if "Access-Control-Request-Headers" in request.headers:
      headers["Access-Control-Allow-Headers"] = request.headers["Access-Control-Request-Headers"]
    return web.Response(status=200, headers=headers)

  # --- helpers ---

  async def tokenizer_for(self, model_id: str):
    """The API node's tokenizer for a model: the engine's if it holds that model, else from local files (the
    embedded model or $EXO_HOME/downloads), else by loading this node's own shard of it."""
    engine = self.node.inference_engine
    shard = getattr(engine, "shard", None)
    if shard is not None and shard.model_id == model_id and getattr(engine, "tokenizer", None) is not None:
      return engine.tokenizer
    if model_id in self._tokenizers:
      return self._tokenizers[model_id]
    async with self._tokenizer_locks.setdefault(model_id, asyncio.Lock()):
      if model_id not in self._tokenizers:
        repo = get_repo(model_id, self.inference_engine_classname)
        local = "dummy" if repo == "dummy" else local_model_path(repo) or (repo_dir(repo) if (repo_dir(repo) / "tokenizer.json").exists() else None)
        if local is not None:
          self._tokenizers[model_id] = await asyncio.to_thread(resolve_tokenizer, local)
        else:
          await engine.ensure_shard(self.node.get_current_shard(build_base_shard(model_id, self.inference_engine_classname)))
          self._tokenizers[model_id] = engine.tokenizer
    return self._tokenizers[model_id]

  async def _read_body(self, request: web.Request) -> dict:
    return parse_json_object(await request.text())

  def _log_error(self, where: str, error: BaseException) -> None:
    if DEBUG >= 1:
      print(f"{where}: {error!r}")
    if DEBUG >= 2:
      traceback.print_exception(error)

  # --- chat ---

  async def handle_chat_completions(self, request: web.Request) -> web.StreamResponse:
    try:
      chat = parse_chat_request(await self._read_body(request), self.default_model, self.inference_engine_classname,
                                self.node.default_sample_temperature)
      tokenizer = await self.tokenizer_for(chat.model)
      prompt = build_prompt(tokenizer, chat.messages, chat.tools, self.system_prompt)
    except BadRequest as e:
      return responses.detail(400, str(e))
    except Exception as e:
      self._log_error("Preparing a chat completion failed", e)
      return responses.detail(500, f"Error processing prompt (see logs with DEBUG>=2): {e}")
    request_id = str(uuid.uuid4())
    if self.on_chat_completion_request is not None:
      try:
        self.on_chat_completion_request(request_id, chat, prompt)
      except Exception as e:
        self._log_error("on_chat_completion_request failed", e)
    prompt_tokens = len(tokenizer.encode(prompt))
    reply = ReplyText(tokenizer.decode, getattr(tokenizer, "eos_token_ids", None) or {tokenizer.eos_token_id}, chat.stop)
    if DEBUG >= 2:
      print(f"[{request_id}] chat completion: model={chat.model} params={chat.params} stop={chat.stop} stream={chat.stream}")
    if chat.stream:
      return await self._stream(request, chat, request_id, prompt, prompt_tokens, reply)
    return await self._complete(chat, request_id, prompt, prompt_tokens, reply)

  def _tokens(self, chat: ChatRequest, request_id: str, prompt: str):
    base_shard = build_base_shard(chat.model, self.inference_engine_classname)
    return aclosing(generate(self.node, base_shard, prompt, chat.params, request_id=request_id, timeout=self.response_timeout))

  async def _complete(self, chat: ChatRequest, request_id: str, prompt: str, prompt_tokens: int, reply: ReplyText) -> web.Response:
    try:
      async with self._tokens(chat, request_id, prompt) as events:
        async for tokens, is_finished in events:
          reply.feed(tokens, is_finished)
          if reply.finish_reason is not None:
            break  # leaving early (stop string) cancels the rest of the generation
    except asyncio.TimeoutError:
      return responses.detail(408, "Response generation timed out")
    except Exception as e:
      self._log_error(f"[{request_id}] generation failed", e)
      return responses.detail(500, f"Error processing prompt (see logs with DEBUG>=2): {e}")
    return responses.json_reply(responses.completion(request_id, chat.model, reply.text, reply.finish_reason,
                                                     responses.usage(prompt_tokens, len(reply.tokens))))

  async def _stream(self, request: web.Request, chat: ChatRequest, request_id: str, prompt: str, prompt_tokens: int, reply: ReplyText) -> web.StreamResponse:
    """SSE in upstream's format. Headers go out with the first token, so failures before it keep their status codes;
    a failure after it ends the stream with an OpenAI-style error event (the openai client raises it)."""
    stream: Optional[web.StreamResponse] = None

    async def send(body) -> None:
      nonlocal stream
      if stream is None:
        stream = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        stream.enable_chunked_encoding()
        request[STREAM_KEY] = stream
        await stream.prepare(request)
      await stream.write(responses.sse(body))

    async def fail(status: int, message: str) -> web.StreamResponse:
      if stream is None:
        return responses.detail(status, message)
      try:
        await send({"error": {"message": message, "type": "server_error", "code": status}})
      except ConnectionError:
        pass
      return stream

    try:
      async with self._tokens(chat, request_id, prompt) as events:
        async for tokens, is_finished in events:
          texts = reply.feed(tokens, is_finished)
          for i, text in enumerate(texts):
            last = reply.finish_reason is not None and i == len(texts) - 1
            usage = responses.usage(prompt_tokens, len(reply.tokens)) if last and chat.include_usage else None
            await send(responses.chunk(request_id, chat.model, text, reply.finish_reason if last else None, usage))
          if reply.finish_reason is not None:
            break
    except asyncio.TimeoutError:
      return await fail(408, "Response generation timed out")
    except ConnectionError:  # the client left mid-stream; leaving the loop has cancelled the generation
      return stream
    except Exception as e:
      self._log_error(f"[{request_id}] generation failed", e)
      return await fail(500, f"Error processing prompt (see logs with DEBUG>=2): {e}")
    return stream

  async def handle_token_encode(self, request: web.Request) -> web.Response:
    try:
      body = await self._read_body(request)
      model = resolve_model(body.get("model"), self.default_model, self.inference_engine_classname)
      tools = body.get("tools")
      tokenizer = await self.tokenizer_for(model)
      prompt = build_prompt(tokenizer, parse_messages(body.get("messages", []), required=False), tools if isinstance(tools, list) else None)
    except BadRequest as e:
      return responses.detail(400, str(e))
    except Exception as e:
      self._log_error("Token encode failed", e)
      return responses.detail(500, f"Error encoding prompt: {e}")
    tokens = [int(t) for t in tokenizer.encode(prompt)]
    return responses.json_reply({"length": len(prompt), "num_tokens": len(tokens), "encoded_tokens": tokens, "encoded_prompt": prompt})

  # --- models, downloads, topology ---

  async def handle_models(self, request: web.Request) -> web.Response:
    return responses.json_reply({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "exo", "ready": True} for m in model_cards]})

  async def handle_initial_models(self, request: web.Request) -> web.Response:
    return responses.json_reply({
      m: {"name": get_pretty_name(m) or m, "downloaded": None, "download_percentage": None, "total_size": None, "total_downloaded": None, "loading": True}
      for m in model_cards if get_repo(m, self.inference_engine_classname) is not None})

  async def handle_model_pool(self, request: web.Request) -> web.StreamResponse:
    """SSE: one event per model this engine can run, saying how much of it is on disk; then [DONE]."""
    stream: Optional[web.StreamResponse] = None

    async def send(body) -> None:
      nonlocal stream
      if stream is None:
        stream = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive"})
        await stream.prepare(request)
      await stream.write(responses.sse(body))

    try:
      async with aclosing(self.node.shard_downloader.get_shard_download_status(self.inference_engine_classname)) as statuses:
        async for _, event in statuses:
          complete = event.status == "complete"
          percentage = 100 if complete else (event.downloaded_bytes / event.total_bytes * 100 if event.total_bytes else 0.0)
          await send({event.shard.model_id: {"downloaded": complete, "download_percentage": percentage, "total_size": event.total_bytes,
                                             "total_downloaded": event.downloaded_bytes}})
      await send("[DONE]")
    except ConnectionError:
      pass
    except Exception as e:
      self._log_error("Model pool status failed", e)
      if stream is None:
        return responses.detail(500, f"Server error: {e}")
      await send("[DONE]")  # the models that could be read were sent; the rest are skipped
    return stream

  async def handle_download_progress(self, request: web.Request) -> web.Response:
    return responses.json_reply({node_id: event.to_dict() for node_id, event in self.node.node_download_progress.items() if event.status == "in_progress"})

  async def handle_download(self, request: web.Request) -> web.Response:
    try:
      body = await self._read_body(request)
    except BadRequest as e:
      return responses.json_reply({"error": str(e)}, 400)
    model = body.get("model")
    if not model:
      return responses.json_reply({"error": "model parameter is required"}, 400)
    if model not in model_cards:
      return responses.json_reply({"error": f"Invalid model: {model}. Supported models: {list(model_cards)}"}, 400)
    shard = build_full_shard(model, self.inference_engine_classname)
    if shard is None:
      return responses.json_reply({"error": f"Could not build shard for model {model}"}, 400)
    try:
      self.node.spawn(self._download(shard))
    except Exception as e:
      return responses.json_reply({"error": str(e)}, 500)
    return responses.json_reply({"status": "success", "message": f"Download started for model: {model}"})

  async def _download(self, shard) -> None:
    try:
      await self.node.shard_downloader.ensure_shard(shard, self.inference_engine_classname)
    except Exception as e:
      self._log_error(f"Download of {shard.model_id} failed", e)

  async def handle_delete_model(self, request: web.Request) -> web.Response:
    model = request.match_info["model_name"]
    try:
      repo = get_repo(model, self.inference_engine_classname)
      if repo is None:
        raise ValueError(f"model {model} has no files for {self.inference_engine_classname}")
      path = repo_dir(repo)
      if not path.exists():
        return responses.detail(404, f"Model {model} files not found")
      await asyncio.to_thread(shutil.rmtree, path)
    except Exception as e:
      return responses.detail(500, f"Error deleting model: {e}")
    return responses.json_reply({"status": "success", "message": f"Model {model} deleted successfully"})

  async def handle_topology(self, request: web.Request) -> web.Response:
    try:
      return responses.json_reply(self.node.current_topology.to_json())
    except Exception as e:
      return responses.detail(500, f"Error getting topology: {e}")

  async def handle_healthcheck(self, request: web.Request) -> web.Response:
    return responses.json_reply({"status": "ok"})

  async def handle_quit(self, request: web.Request) -> web.StreamResponse:
    response = responses.json_reply({"detail": "Quit signal received"})
    await response.prepare(request)
    await response.write_eof()  # the client has its answer before the node goes away
    if self.on_quit is not None:
      asyncio.get_running_loop().call_soon(self.on_quit)
    return response

  # --- images (no engine of this build generates images) ---

  async def handle_image_generations(self, request: web.Request) -> web.Response:
    try:
      body = await self._read_body(request)
    except BadRequest as e:
      return responses.json_reply({"error": str(e)}, 400)
    # Image models (stable-diffusion) run only on upstream's MLX engine; none is in this build's registry.
    return responses.json_reply({"error": f"Unsupported model: {body.get('model')} with inference engine {self.inference_engine_classname}"}, 400)

  async def handle_create_animation(self, request: web.Request) -> web.Response:
    try:
      body = await self._read_body(request)
    except BadRequest as e:
      return responses.json_reply({"error": str(e)}, 400)
    if not body.get("replacement_image_path"):
      return responses.json_reply({"error": "replacement_image_path is required"}, 400)
    return responses.json_reply({"error": "animations are rendered by the macOS app, which this build does not include"}, 500)

  # --- static ---

  async def handle_root(self, request: web.Request) -> web.FileResponse:
    return web.FileResponse(TINYCHAT_DIR / "index.html")

  async def handle_image_file(self, request: web.Request) -> web.FileResponse:
    path = (IMAGES_DIR / request.match_info["file_name"]).resolve()
    if path.parent != IMAGES_DIR.resolve() or not path.is_file():
      raise web.HTTPNotFound()
    return web.FileResponse(path)

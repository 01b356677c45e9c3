"""The ChatGPT-compatible HTTP API every node serves, and the tinychat web page.

Success replies keep upstream exo's shapes; every error is OpenAI's {"error": {"message", "type", "param", "code"}}.
A request passes, in order: the error middleware (ApiError and aiohttp's own errors become that JSON), access
(API key, Origin, content type: exo/api/access.py), the response deadline, then its handler. Request bodies are
parsed, templated and tokenised on a small thread pool, never on the event loop that carries gRPC and every open
stream; a chat or completion request then waits for a place per choice (exo/api/admission.py, exo/api/choices.py)
before it reaches the ring."""
import asyncio
import shutil
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from exo.api import responses
from exo.api.access import Access
from exo.api.admission import Admission
from exo.api.answer import AnswerPlan, plan_answer
from exo.api.choices import Choice, run_choices
from exo.api.completion_request import CompletionRequest, Prompt, parse_completion_request
from exo.api.downloads import download_api_error, downloads_view, peer_download_api_error
from exo.api.chat_request import ChatRequest, build_prompt, parse_chat_request, parse_json_body, parse_messages, parse_tools, resolve_model
from exo.api.errors import ApiError, BadRequest
from exo.api.event_stream import STREAM_KEY, EventStream
from exo.api.metrics import ApiMetrics
from exo.api.model_limits import ModelLimits
from exo.api.reply_text import ReplyText
from exo.api.settings import ApiSettings
from exo.download.errors import DownloadError
from exo.download.shard_download import local_model_path, repo_dir
from exo.helpers import DEBUG
from exo.inference.sampling import SamplingParams
from exo.inference.tokenizers import eos_ids, resolve_tokenizer
from exo.inference.weights import load_config
from exo.models import build_base_shard, build_full_shard, get_pretty_name, get_repo, model_cards
from exo.orchestration.generation import generate_events

TINYCHAT_DIR = Path(__file__).resolve().parent.parent / "tinychat"
IMAGES_DIR = Path.home() / "Documents" / "Exo" / "Images"
PROMPT_THREADS = 2  # parsing, templating and tokenising: enough to keep up, few enough to leave the engine its cores
PUBLIC_PATHS = {"/healthcheck", "/health"}  # answered without the API key (load balancers, liveness probes)


class ChatGPTAPI:
  def __init__(self, node, inference_engine_classname: str, response_timeout: float = 90, on_chat_completion_request: Optional[Callable] = None,
               default_model: Optional[str] = None, system_prompt: Optional[str] = None, on_quit: Optional[Callable[[], None]] = None,
               settings: Optional[ApiSettings] = None):
    self.node = node
    self.inference_engine_classname = inference_engine_classname
    self.response_timeout = response_timeout
    self.on_chat_completion_request = on_chat_completion_request
    self.default_model = default_model or "llama-3.2-1b"
    self.system_prompt = system_prompt
    self.on_quit = on_quit
    self.settings = settings or ApiSettings()
    self.access = Access(self.settings.allowed_origins, self.settings.api_key)
    self.admission = Admission(self.settings.max_running, self.settings.max_queued, self.settings.kv_budget_bytes)
    self.metrics = ApiMetrics(node, self.admission)
    self.prompt_pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="exo-api-prompt")
    self.runner: Optional[web.AppRunner] = None
    self.stopping = False
    self._profiles: Dict[str, Tuple[object, ModelLimits]] = {}
    self._profile_locks: Dict[str, asyncio.Lock] = {}
    self.app = web.Application(client_max_size=self.settings.max_body_bytes, middlewares=[self._errors, self._guard, self._deadline])
    self.app.on_response_prepare.append(self._add_cors_headers)
    for paths, method, handler in [
      (("/v1/chat/completions", "/chat/completions"), "POST", self.handle_chat_completions),
      (("/v1/completions", "/completions"), "POST", self.handle_completions),
      (("/v1/chat/token/encode", "/chat/token/encode"), "POST", self.handle_token_encode),
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
    ]:
      for path in paths:
        self.app.router.add_route(method, path, handler)
        self.app.router.add_route("OPTIONS", path, self.handle_preflight)
    self.app.router.add_get("/images/{file_name}", self.handle_image_file)
    self.app.router.add_get("/{path:.*}", self.handle_static)  # last: it claims every other path for GET

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
    self.prompt_pool.shutdown(wait=False, cancel_futures=True)

  # --- middlewares ---

  @web.middleware
  async def _errors(self, request: web.Request, handler):
    """Every error a request meets becomes OpenAI's JSON shape; nothing unforeseen reaches the client as a bare 500."""
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
      self._log_error(f"{request.method} {request.path} failed", e)
      error = ApiError(500, f"Server error (see logs with DEBUG>=2): {e!r}")
    self._count_error(error)
    return responses.error_reply(error)

  def _http_error(self, request: web.Request, e: web.HTTPException) -> ApiError:
    if e.status == 413:
      return ApiError(413, f"the request body is larger than this node's limit of {self.settings.max_body_bytes:,} bytes "
                           f"(EXO_MAX_REQUEST_BODY_MB)", code="request_too_large")
    if e.status == 404:
      return ApiError(404, f"nothing here: {request.method} {request.path}", code="not_found")
    if e.status == 405:
      return ApiError(405, f"{request.method} is not allowed on {request.path}", code="method_not_allowed", headers={"Allow": e.headers.get("Allow", "")})
    return ApiError(e.status, e.reason)

  def _is_static(self, request: web.Request) -> bool:
    return request.match_info.route.handler in (self.handle_static, self.handle_image_file)

  @web.middleware
  async def _guard(self, request: web.Request, handler):
    self.access.check(request, public=request.path in PUBLIC_PATHS or self._is_static(request))
    return await handler(request)

  @web.middleware
  async def _deadline(self, request: web.Request, handler):
    """Every handler runs under response_timeout: 504 if nothing was sent yet, else its stream ends with an error event."""
    try:
      async with asyncio.timeout(self.response_timeout):
        return await handler(request)
    except TimeoutError:
      error = self._timeout_error()
      stream = request.get(STREAM_KEY)
      if stream is None:
        raise error from None
      self._count_error(error)
      await stream.fail(error)
      return stream.response

  def _timeout_error(self) -> ApiError:
    return ApiError(504, f"the reply took longer than this node's response timeout of {self.response_timeout:g} s "
                         "(--chatgpt-api-response-timeout)", code="response_timeout")

  async def _add_cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
    if not self._is_static(request):
      self.access.add_cors_headers(request, response)

  async def handle_preflight(self, request: web.Request) -> web.Response:
    return self.access.preflight(request)

  # --- helpers ---

  def _count_error(self, error: ApiError) -> None:
    self.metrics.errors.labels(kind=error.code or error.type).inc()
    if error.status == 429:
      self.metrics.rejected.inc()

  def _log_error(self, where: str, error: BaseException) -> None:
    if DEBUG >= 1:
      print(f"{where}: {error!r}")
    if DEBUG >= 2:
      traceback.print_exception(error)

  async def _in_thread(self, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, fn, *args)

  async def _read_json(self, request: web.Request) -> dict:
    return await self._in_thread(parse_json_body, await request.read())

  def _local_files(self, repo: str):
    """Where a model's tokenizer and config are on this machine without a download: the embedded model, a local
    checkpoint, or None."""
    if repo == "dummy":
      return "dummy"
    return local_model_path(repo)

  async def model_profile(self, model_id: str) -> Tuple[object, ModelLimits]:
    """A model's tokenizer and limits, read from its files: the embedded model, a local checkpoint, or this node's
    shard of a download (which ends at once when it is complete on disk, and raises DownloadError when it fails).
    Never by loading the engine, which would wipe the KV caches of the requests it serves."""
    if model_id in self._profiles:
      return self._profiles[model_id]
    async with self._profile_locks.setdefault(model_id, asyncio.Lock()):
      if model_id not in self._profiles:
        local = self._local_files(get_repo(model_id, self.inference_engine_classname))
        if local == "dummy":
          profile = (resolve_tokenizer("dummy"), ModelLimits())
        elif local is not None:
          profile = (await asyncio.to_thread(resolve_tokenizer, local), ModelLimits.of(await asyncio.to_thread(load_config, local)))
        else:  # its files first (this node's shard of them): loading the engine would wipe the caches of the requests it serves
          base = build_base_shard(model_id, self.inference_engine_classname)
          path = await self.node.shard_downloader.ensure_shard(self.node.own_shard(base), self.inference_engine_classname)
          profile = (await asyncio.to_thread(resolve_tokenizer, path), ModelLimits.of(await asyncio.to_thread(load_config, path)))
        self._profiles[model_id] = profile
    return self._profiles[model_id]

  async def tokenizer_for(self, model_id: str):
    return (await self.model_profile(model_id))[0]

  # --- chat ---

  def _parse_chat(self, raw: bytes) -> ChatRequest:
    return parse_chat_request(parse_json_body(raw), self.default_model, self.inference_engine_classname, self.node.default_sample_temperature)

  def _template(self, tokenizer, chat: ChatRequest) -> Tuple[str, List[int], AnswerPlan]:
    plan = plan_answer(tokenizer, chat.messages, chat.response_format, chat.tool_use, chat.tools)
    prompt = build_prompt(tokenizer, plan.messages, plan.tools, self.system_prompt)
    return prompt, list(tokenizer.encode(prompt)), plan

  async def handle_chat_completions(self, request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    chat = await self._in_thread(self._parse_chat, await request.read())
    async with self.admission.places(chat.n) as tickets:
      tokenizer, limits = await self.model_profile(chat.model)
      prompt, prompt_ids, plan = await self._in_thread(self._template, tokenizer, chat)
      prompt_tokens = len(prompt_ids)
      chat.params = replace(chat.params, max_tokens=limits.reply_budget(prompt_tokens, chat.params.max_tokens), grammar=plan.grammar)
      request_id = str(uuid.uuid4())
      if self.on_chat_completion_request is not None:
        try:
          self.on_chat_completion_request(request_id, chat, prompt)
        except Exception as e:
          self._log_error("on_chat_completion_request failed", e)
      if DEBUG >= 2:
        print(f"[{request_id}] chat completion: model={chat.model} params={chat.params} n={chat.n} stop={chat.stop} stream={chat.stream}")
      choices = self._choices(request_id, chat.model, [(prompt, prompt_ids, chat.params, "")], chat.n, chat.stop, tokenizer, limits, tickets, plan)
      shape = responses.ChatShape(request_id, chat.model, _token_text(tokenizer))
      return await self._reply(request, shape, chat.model, choices, [prompt_tokens], chat.stream, chat.include_usage, arrived)

  # --- completions (legacy) ---

  def _parse_completion(self, raw: bytes) -> CompletionRequest:
    return parse_completion_request(parse_json_body(raw), self.default_model, self.inference_engine_classname, self.node.default_sample_temperature)

  @staticmethod
  def _prompt_texts(tokenizer, prompts: List[Prompt]) -> List[Tuple[str, List[int]]]:
    """Each prompt's text and token ids. Token ids are checked against the vocabulary and sent as their text (the
    ring takes text), which the first node tokenises again."""
    texts = []
    for i, prompt in enumerate(prompts):
      if isinstance(prompt, str):
        texts.append((prompt, list(tokenizer.encode(prompt))))
        continue
      vocab, name = getattr(tokenizer, "vocab_size", None), "prompt" if len(prompts) == 1 else f"prompt[{i}]"
      if vocab is not None and max(prompt) >= vocab:
        raise BadRequest(f"{name} has token id {max(prompt)}; this model's vocabulary has {vocab:,} tokens", param=name)
      texts.append((tokenizer.decode(prompt), list(prompt)))
    return texts

  async def handle_completions(self, request: web.Request) -> web.StreamResponse:
    arrived = time.monotonic()
    job = await self._in_thread(self._parse_completion, await request.read())
    async with self.admission.places(len(job.prompts) * job.n) as tickets:
      tokenizer, limits = await self.model_profile(job.model)
      prompts = await self._in_thread(self._prompt_texts, tokenizer, job.prompts)
      runs = [(text, ids, replace(job.params, max_tokens=limits.reply_budget(len(ids), job.params.max_tokens, param="prompt")), text if job.echo else "")
              for text, ids in prompts]
      request_id = str(uuid.uuid4())
      choices = self._choices(request_id, job.model, runs, job.n, job.stop, tokenizer, limits, tickets)
      shape = responses.TextShape(request_id, job.model, _token_text(tokenizer), {c.index: len(c.echo) for c in choices})
      return await self._reply(request, shape, job.model, choices, [len(ids) for _, ids in prompts], job.stream, job.include_usage, arrived)

  # --- what chat and completions share ---

  def _choices(self, request_id: str, model: str, runs: List[Tuple[str, List[int], SamplingParams, str]], n: int, stop: List[str], tokenizer,
               limits: ModelLimits, tickets: List, plan: Optional[AnswerPlan] = None) -> List[Choice]:
    """n choices for each (prompt, its token ids, its params, echo text); each a request of its own in the ring, with
    its own random stream (seed + index when a seed is given), and its own reading of tool calls when it may make some."""
    eos = eos_ids(tokenizer)
    cap = self.node.max_generate_tokens
    layers_here = self.node.own_shard(build_base_shard(model, self.inference_engine_classname)).get_layer_count()
    choices: List[Choice] = []
    for p, (prompt, prompt_ids, params, echo) in enumerate(runs):
      kv_bytes = limits.kv_bytes(len(prompt_ids) + min(params.max_tokens or cap, cap), layers_here)
      first = None
      for j in range(n):
        index = p * n + j
        seeded = params if params.seed is None else replace(params, seed=(params.seed + index) % 2**64)
        complete = plan.completed_by(tokenizer) if plan is not None else None
        choice = Choice(index, request_id if index == 0 else f"{request_id}-{index}", prompt, seeded, tickets[index], kv_bytes,
                        ReplyText(tokenizer.decode, eos, stop, complete), echo, first=first, tools=plan and plan.tool_stream(), prompt_ids=prompt_ids)
        first = first or choice
        choices.append(choice)
    return choices

  async def _reply(self, request: web.Request, shape, model: str, choices: List[Choice], prompt_tokens: List[int], stream: bool,
                   include_usage: bool, arrived: float) -> web.StreamResponse:
    self.metrics.prompt_tokens.inc(sum(prompt_tokens))
    for choice in choices:
      self.admission.kv_budget_check(choice.kv_bytes)
    chunks = run_choices(choices, lambda choice: self._generation(model, choice, arrived))

    def usage() -> dict:
      return responses.usage(sum(prompt_tokens), sum(len(c.reply.tokens) for c in choices))
    if stream:
      return await self._stream(request, shape, chunks, len(choices), usage if include_usage else None)
    try:
      async with aclosing(chunks):
        async for _ in chunks:
          pass
    except Exception as e:
      raise self._generation_error(shape.request_id, e) from None
    return responses.json_reply(shape.reply([(c.index, c.content, c.finish_reason, c.pairs, c.tool_calls) for c in choices], usage()))

  async def _generation(self, model: str, choice: Choice, arrived: float):
    """One choice's token events, timed for the metrics. Leaving early cancels the generation in the ring."""
    base_shard = build_base_shard(model, self.inference_engine_classname)
    last = None
    async with aclosing(generate_events(self.node, base_shard, choice.prompt, choice.params, choice.request_id, self.response_timeout,
                                              choice.prompt_ids)) as events:
      async for event in events:
        now = time.monotonic()
        (self.metrics.ttft.observe(now - arrived) if last is None else self.metrics.itl.observe(now - last))
        last = now
        self.metrics.generation_tokens.inc(len(event.tokens))
        yield event

  def _generation_error(self, request_id: str, e: Exception) -> ApiError:
    if isinstance(e, ApiError):
      return e
    if isinstance(e, TimeoutError):
      return self._timeout_error()
    peer_download = peer_download_api_error(str(e))  # the ring's download failed, here or on another node
    if peer_download is not None:
      return peer_download
    self._log_error(f"[{request_id}] generation failed", e)
    return ApiError(500, f"Error processing prompt (see logs with DEBUG>=2): {e}", code="generation_failed")

  async def _stream(self, request: web.Request, shape, chunks, unfinished: int, usage: Optional[Callable[[], dict]]) -> web.StreamResponse:
    """SSE in upstream's format, each chunk with its choice's index; the chunk that ends the last choice carries the
    usage when asked. A failure after the first event ends the stream with an error event."""
    stream = EventStream(request, {}, shape.error_chunk)
    try:
      async with aclosing(chunks):
        async for chunk in chunks:
          unfinished -= chunk.finish_reason is not None
          usage_ = usage() if usage is not None and not unfinished else None
          await stream.send(shape.chunk(chunk.index, chunk.text, chunk.finish_reason, chunk.pairs, usage_, chunk.tool_calls))
    except ConnectionError:  # the client left mid-stream; leaving the loop has cancelled the generations
      return stream.response
    except Exception as e:
      error = self._generation_error(shape.request_id, e)
      if not stream.started:
        raise error from None
      self._count_error(error)
      await stream.fail(error)
    return stream.response

  async def handle_token_encode(self, request: web.Request) -> web.Response:
    body = await self._read_json(request)
    model = resolve_model(body.get("model"), self.default_model, self.inference_engine_classname)
    messages, tools = parse_messages(body.get("messages"), required=False), parse_tools(body)
    tokenizer = await self.tokenizer_for(model)

    def encode() -> Tuple[str, list]:
      prompt = build_prompt(tokenizer, messages, tools)
      return prompt, [int(t) for t in tokenizer.encode(prompt)]
    prompt, tokens = await self._in_thread(encode)
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
    stream = EventStream(request, {"Connection": "keep-alive"})
    try:
      async with aclosing(self.node.shard_downloader.get_shard_download_status(self.inference_engine_classname)) as statuses:
        async for _, event in statuses:
          complete = event.status == "complete"
          percentage = 100 if complete else (event.downloaded_bytes / event.total_bytes * 100 if event.total_bytes else 0.0)
          await stream.send({event.shard.model_id: {"downloaded": complete, "download_percentage": percentage, "total_size": event.total_bytes,
                                                    "total_downloaded": event.downloaded_bytes}})
      await stream.send("[DONE]")
    except ConnectionError:
      pass
    except Exception as e:
      self._log_error("Model pool status failed", e)
      if not stream.started:
        raise ApiError(500, f"Server error: {e}") from None
      await stream.send("[DONE]")  # the models that could be read were sent; the rest are skipped
    return stream.response

  async def handle_download_progress(self, request: web.Request) -> web.Response:
    return responses.json_reply({node_id: event.to_dict() for node_id, event in self.node.node_download_progress.items() if event.status == "in_progress"})

  async def handle_downloads(self, request: web.Request) -> web.Response:
    return responses.json_reply(downloads_view(self.node.shard_downloader))

  def _known_model(self, model, param: str) -> str:
    if not isinstance(model, str) or not model:
      raise BadRequest(f"{param} is required: a model id such as {next(iter(model_cards))!r}", param=param)
    if model not in model_cards:
      raise ApiError(404, f"Invalid model: {model}. Supported models: {list(model_cards)}", param=param, code="model_not_found")
    return model

  async def handle_download(self, request: web.Request) -> web.Response:
    model = self._known_model((await self._read_json(request)).get("model"), "model")
    shard = build_full_shard(model, self.inference_engine_classname)
    if shard is None:
      raise BadRequest(f"Could not build shard for model {model}: it has no files for {self.inference_engine_classname}", param="model",
                       code="model_not_supported")
    self.node.spawn(self._download(shard))
    return responses.json_reply({"status": "success", "message": f"Download started for model: {model}"})

  async def _download(self, shard) -> None:
    try:
      await self.node.shard_downloader.ensure_shard(shard, self.inference_engine_classname)
    except Exception as e:
      self._log_error(f"Download of {shard.model_id} failed", e)

  async def handle_delete_model(self, request: web.Request) -> web.Response:
    model = self._known_model(request.match_info["model_name"], "model_name")
    repo = get_repo(model, self.inference_engine_classname)
    if repo is None:
      raise BadRequest(f"model {model} has no files for {self.inference_engine_classname}", param="model_name", code="model_not_supported")
    path = repo_dir(repo)
    if getattr(self.node.shard_downloader, "is_downloading", lambda repo: False)(repo):
      raise ApiError(409, f"Model {model} is downloading; delete its files once the download has ended", param="model_name", code="download_in_progress")
    if not path.exists():
      raise ApiError(404, f"Model {model} files not found", param="model_name", code="model_files_not_found")
    try:
      await asyncio.to_thread(shutil.rmtree, path)
    except OSError as e:
      raise ApiError(500, f"Error deleting model: {e}") from None
    return responses.json_reply({"status": "success", "message": f"Model {model} deleted successfully"})

  async def handle_topology(self, request: web.Request) -> web.Response:
    """The topology as upstream shows it, and the placement: the groups of each model (this node's default model and
    the one its engine holds) with each node's layers."""
    models = [build_base_shard(self.default_model, self.inference_engine_classname), self.node.inference_engine.shard]
    bases = list({(s.model_id, s.n_layers): s for s in models if s is not None}.values())
    return responses.json_reply({**self.node.current_topology.to_json(), "placement": self.node.placement_view(bases)})

  async def handle_healthcheck(self, request: web.Request) -> web.Response:
    return responses.json_reply({"status": "ok"})

  async def handle_state(self, request: web.Request) -> web.Response:
    """This node's live requests (id, model, status, positions, KV bytes) and its KV memory in all."""
    return responses.json_reply(self.node.state())

  async def handle_health(self, request: web.Request) -> web.Response:
    """Readiness: 200 while this node takes new requests; 503 while it is stopping or every place is taken."""
    admission = self.admission
    status = "stopping" if self.stopping else "overloaded" if admission.full() else "ok"
    return responses.json_reply({"status": status, "requests_running": admission.running, "requests_waiting": admission.waiting,
                                 "peers": len(self.node.peers)}, 200 if status == "ok" else 503)

  async def handle_metrics(self, request: web.Request) -> web.Response:
    return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

  async def handle_quit(self, request: web.Request) -> web.StreamResponse:
    response = responses.json_reply({"detail": "Quit signal received"})
    await response.prepare(request)
    await response.write_eof()  # the client has its answer before the node goes away
    if self.on_quit is not None:
      asyncio.get_running_loop().call_soon(self.on_quit)
    return response

  # --- images (no engine of this build generates images) ---

  async def handle_image_generations(self, request: web.Request) -> web.Response:
    body = await self._read_json(request)
    # Image models (stable-diffusion) run only on upstream's MLX engine; none is in this build's registry.
    raise BadRequest(f"Unsupported model: {body.get('model')} with inference engine {self.inference_engine_classname}", param="model",
                     code="model_not_supported")

  async def handle_create_animation(self, request: web.Request) -> web.Response:
    body = await self._read_json(request)
    if not body.get("replacement_image_path"):
      raise BadRequest("replacement_image_path is required", param="replacement_image_path")
    raise ApiError(501, "animations are rendered by the macOS app, which this build does not include", code="not_implemented")

  # --- static ---

  async def handle_static(self, request: web.Request) -> web.FileResponse:
    """tinychat's files; `/` is its page."""
    return _file_in(TINYCHAT_DIR, request.match_info["path"] or "index.html", request)

  async def handle_image_file(self, request: web.Request) -> web.FileResponse:
    return _file_in(IMAGES_DIR, request.match_info["file_name"], request)


def _token_text(tokenizer) -> Callable[[int], str]:
  return lambda token: tokenizer.decode([token])


def _file_in(folder: Path, name: str, request: web.Request) -> web.FileResponse:
  path = (folder / name).resolve()
  if not path.is_relative_to(folder.resolve()) or not path.is_file():
    raise ApiError(404, f"nothing here: {request.method} {request.path}", code="not_found")
  return web.FileResponse(path)

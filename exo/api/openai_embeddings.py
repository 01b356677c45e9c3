"""OpenAI's POST /v1/embeddings: {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage"}, each embedding a list of floats or, with `encoding_format: "base64"` (what the `openai` client asks for
unless told otherwise, decoding it itself), the base64 of its little-endian float32 bytes."""
import base64
from typing import Callable, List, Tuple

import numpy as np
from aiohttp import web

from exo.api.embedding_request import parse_openai_embedding
from exo.api.request_fields import parse_json_body
from exo.api.serving import ServingCore


def encoded(vector: np.ndarray, encoding_format: str):
  if encoding_format == "base64":
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
  return vector.tolist()


class OpenAIEmbeddingRoutes:
  def __init__(self, core: ServingCore):
    self.core = core

  def routes(self) -> List[Tuple[Tuple[str, ...], str, Callable]]:
    return [(("/v1/embeddings", "/embeddings"), "POST", self.handle_embeddings)]

  async def handle_embeddings(self, request: web.Request) -> web.Response:
    raw = await request.read()
    embedding = await self.core.in_thread(lambda: parse_openai_embedding(parse_json_body(raw)))
    vectors, tokens = await self.core.embeddings.embed(embedding)
    return await self.core.embeddings.reply(lambda: {
      "object": "list", "data": [{"object": "embedding", "index": i, "embedding": encoded(v, embedding.encoding_format)} for i, v in enumerate(vectors)],
      "model": embedding.model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

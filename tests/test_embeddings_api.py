"""Embeddings over HTTP from unmodified clients against a real node: the official `openai` client (its default
base64 and float), LangChain's OpenAIEmbeddings set up as its docs say for other servers, the `ollama` client's
embed and embeddings; each vector equal to sentence-transformers' (the stored reference). Bad input is a 400 naming
its field. The node's chat engine is the dummy one: embeddings run on the node itself, never in the ring."""
import base64
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import numpy as np
import ollama
import pytest
from langchain_openai import OpenAIEmbeddings

from tests.support.api_server import openai_client, shared_server

pytestmark = pytest.mark.model

REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "minilm_reference.json").read_text())
TEXTS = [t["text"] for t in REFERENCE["texts"]]
EXPECTED = np.array([t["embedding"] for t in REFERENCE["texts"]])


@pytest.fixture(scope="module")
def server():
  return shared_server("dummy")


def assert_reference(vectors, expected=EXPECTED):
  vectors = np.asarray(vectors, dtype=np.float64)
  assert vectors.shape == expected.shape
  cosines = (vectors * expected).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(expected, axis=1)
  assert cosines.min() >= 0.9999, cosines


def test_openai_client_default_base64(server):
  reply = openai_client(server).embeddings.create(model="all-minilm-l6-v2", input=TEXTS)  # the client asks for base64, decodes it
  assert [d.index for d in reply.data] == list(range(len(TEXTS)))
  assert_reference([d.embedding for d in reply.data])
  assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(t["tokens"] for t in REFERENCE["texts"])
  assert reply.model == "all-minilm-l6-v2"


def test_openai_client_float_and_its_default_model_name(server):
  client = openai_client(server)
  # OpenAI's names mean the default embedding model; `dimensions` at the model's own size is honoured as it is
  reply = client.embeddings.create(model="text-embedding-3-small", input=TEXTS[1], encoding_format="float", dimensions=384)
  assert_reference([reply.data[0].embedding], EXPECTED[1:2])


async def post(server, path: str, body: dict):
  async with aiohttp.ClientSession() as session:
    async with session.post(server.url + path, json=body) as r:
      return r.status, await r.json()


async def test_base64_is_little_endian_float32_on_the_wire(server):
  status, body = await post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
  assert status == 200 and body["object"] == "list" and body["data"][0]["object"] == "embedding"
  vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
  assert_reference([vector], EXPECTED[:1])


async def test_token_ids_are_the_models_own(server):
  ids = [101, 7592, 1010, 2088, 999, 102]  # "Hello, world!" as the model's tokenizer gives it
  status, one = await post(server, "/v1/embeddings", {"input": ids})
  assert status == 200 and one["usage"]["prompt_tokens"] == 6
  assert_reference([one["data"][0]["embedding"]], EXPECTED[:1])
  status, two = await post(server, "/v1/embeddings", {"input": [ids, ids[:3] + [102]]})
  assert status == 200 and len(two["data"]) == 2 and two["data"][0]["embedding"] == one["data"][0]["embedding"]


def test_langchain_openai_embeddings(server):
  # As LangChain's docs set OpenAIEmbeddings up for servers other than OpenAI's: send the texts, not tiktoken's ids.
  embeddings = OpenAIEmbeddings(model="all-minilm-l6-v2", base_url=f"{server.url}/v1", api_key="exo", check_embedding_ctx_length=False,
                                max_retries=0)
  assert_reference(embeddings.embed_documents(TEXTS))
  assert_reference([embeddings.embed_query(TEXTS[2])], EXPECTED[2:3])


def test_ollama_client_embed_and_embeddings(server):
  client = ollama.Client(host=server.url, timeout=120)
  reply = client.embed(model="all-minilm", input=TEXTS)
  assert_reference(reply.embeddings)
  assert reply.prompt_eval_count == sum(t["tokens"] for t in REFERENCE["texts"])
  assert_reference([client.embed(model="all-minilm:latest", input=TEXTS[3]).embeddings[0]], EXPECTED[3:4])
  assert_reference([client.embeddings(model="all-minilm", prompt=TEXTS[4]).embedding], EXPECTED[4:5])


def test_ollama_client_unknown_model_is_not_found(server):
  with pytest.raises(ollama.ResponseError) as e:
    ollama.Client(host=server.url, timeout=60).embed(model="nomic-embed-text", input="hello")
  assert e.value.status_code == 404 and "nomic-embed-text" in e.value.error


LONG = "word " * 400  # 402 tokens, past the model's 256


@pytest.mark.parametrize("path, body, field, words", [
  ("/v1/embeddings", {"input": []}, "input", "empty"),
  ("/v1/embeddings", {"input": ["a"] * 10000}, "input", "2048"),
  ("/v1/embeddings", {"input": [[101, "x", 102]]}, "input[0][1]", "token id"),
  ("/v1/embeddings", {"input": [101, 2.5, 102]}, "input[1]", "token id"),
  ("/v1/embeddings", {"input": [[]]}, "input[0]", "empty"),
  ("/v1/embeddings", {"input": ["a", [101, 102]]}, "input", "mixes"),
  ("/v1/embeddings", {"input": [101, 99999, 102]}, "input", "vocabulary"),
  ("/v1/embeddings", {"input": [101] + [1000] * 3000 + [102]}, "input", "3002 tokens long, more than all-minilm-l6-v2's limit of 256"),
  ("/v1/embeddings", {"input": "a", "dimensions": 1000}, "dimensions", "at most 384"),
  ("/v1/embeddings", {"input": "a", "dimensions": 100}, "dimensions", "cannot shorten"),
  ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions", ">= 1"),
  ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format", "base64"),
  ("/v1/embeddings", {}, "input", "required"),
  ("/v1/embeddings", {"input": LONG}, "input", "256"),
  ("/v1/embeddings", {"input": ["a", LONG]}, "input", "input[1] is 402 tokens long"),
  ("/v1/embeddings", {"input": "a", "model": "smollm2-135m"}, "model", "not an embedding model"),
  ("/v1/embeddings", {"input": "a", "temperature": 0}, "temperature", "Unrecognized"),
  ("/api/embed", {"model": "all-minilm", "input": []}, None, "empty"),
  ("/api/embed", {"model": "all-minilm", "input": [1, 2]}, None, "input[0]"),
  ("/api/embed", {"model": "all-minilm", "input": LONG, "truncate": False}, None, "256"),
  ("/api/embed", {"input": "a"}, None, "model is required"),
  ("/api/embeddings", {"model": "all-minilm"}, None, "prompt"),
])
async def test_bad_input_is_a_400_naming_the_field(server, path, body, field, words):
  status, reply = await post(server, path, body)
  assert status == 400, reply
  message = reply["error"]["message"] if isinstance(reply["error"], dict) else reply["error"]
  assert words in message
  if field is not None:
    assert reply["error"]["param"] == field


async def test_over_long_inputs_are_cut_where_asked(server):
  status, body = await post(server, "/v1/embeddings", {"input": [LONG, "a"], "truncate": True})
  assert status == 200 and body["usage"]["prompt_tokens"] == 256 + 3
  status, ollama_body = await post(server, "/api/embed", {"model": "all-minilm", "input": [LONG, "a"]})  # Ollama cuts by default
  assert status == 200 and ollama_body["prompt_eval_count"] == 256 + 3
  assert np.allclose(ollama_body["embeddings"], [d["embedding"] for d in body["data"]], atol=1e-6)


def test_concurrent_requests_each_get_their_own_vectors(server):
  client = openai_client(server)
  with ThreadPoolExecutor(16) as pool:
    replies = list(pool.map(lambda i: client.embeddings.create(model="all-minilm-l6-v2", input=TEXTS[i % len(TEXTS)]), range(32)))
  for i, reply in enumerate(replies):
    assert_reference([reply.data[0].embedding], EXPECTED[i % len(TEXTS):i % len(TEXTS) + 1])

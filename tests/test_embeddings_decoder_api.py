"""Qwen3-Embedding through a real exo node: the registry's card downloads the model from a stand-in hub (serving the
tiny fixture of tests/fixtures/make_qwen3_embedding.py as Qwen/Qwen3-Embedding-0.6B) the way chat models download, and
a copy under the node's --models-dir is served by its path. Unmodified clients (the official `openai` client, the
`ollama` client) get sentence-transformers' vectors (the fixture's reference.json): for single inputs, a batch of
different lengths, Matryoshka `dimensions`, and the query prompt asked for by name."""
import asyncio
import json
import shutil
from pathlib import Path

import numpy as np
import ollama
import openai
import pytest

from tests.support.cluster import Cluster
from tests.support.stand_in_hub import StandInHub

pytestmark = pytest.mark.cluster

FIXTURE = Path(__file__).parent / "fixtures" / "qwen3_embedding"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
TEXTS = [t["text"] for t in REFERENCE["texts"]]
REPO = "Qwen/Qwen3-Embedding-0.6B"


def expected(key: str) -> np.ndarray:
  return np.array([t[key] for t in REFERENCE["texts"]], dtype=np.float64)


def assert_reference(vectors, reference: np.ndarray) -> None:
  vectors = np.asarray(vectors, dtype=np.float64)
  assert vectors.shape == reference.shape
  cosines = (vectors * reference).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(reference, axis=1)
  assert cosines.min() >= 0.9999, cosines


@pytest.fixture(scope="module")
def node(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("qwen3_embedding")
  repo = tmp / "repo"
  shutil.copytree(FIXTURE, repo, ignore=shutil.ignore_patterns("reference.json"))  # as the real repository holds it
  served = tmp / "models"
  shutil.copytree(repo, served / "my-embedder")
  hub = StandInHub().start()
  hub.add_repo(REPO, repo)
  cluster = Cluster(tmp, ["embed-node"], "numpy", {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp / "hf"), "HF_TOKEN": ""})
  cluster.nodes["embed-node"].args += ["--models-dir", str(served)]
  try:
    asyncio.run(cluster.start())
    yield cluster.url("embed-node"), hub, served / "my-embedder"
  finally:
    cluster.stop()
    hub.stop()


def client(url: str) -> openai.OpenAI:
  return openai.OpenAI(base_url=f"{url}/v1", api_key="exo", timeout=180, max_retries=0)


def test_downloaded_on_first_use_then_single_inputs_and_a_batch(node):
  url, hub, _ = node
  embeddings = client(url).embeddings
  batch = embeddings.create(model="qwen3-embedding-0.6b", input=TEXTS)  # base64, as the client asks by default
  assert_reference([d.embedding for d in batch.data], expected("batched"))
  assert batch.usage.prompt_tokens == sum(len(t["tokens"]) for t in REFERENCE["texts"])  # <|endoftext|> counted
  alone = [embeddings.create(model="Qwen/Qwen3-Embedding-0.6B", input=text, encoding_format="float").data[0].embedding for text in TEXTS]
  assert_reference(alone, expected("alone"))
  assert hub.fetches("model.safetensors", REPO) == [None]  # fetched once, whole, then read from the node's downloads


def test_dimensions_shorten_and_renormalise(node):
  url, _, _ = node
  reply = client(url).embeddings.create(model="qwen3-embedding-0.6b", input=TEXTS, dimensions=32, encoding_format="float")
  vectors = np.array([d.embedding for d in reply.data])
  assert vectors.shape == (len(TEXTS), 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
  assert_reference(vectors, expected("batched")[:, :32])
  with pytest.raises(openai.BadRequestError, match="dimensions"):
    client(url).embeddings.create(model="qwen3-embedding-0.6b", input="x", dimensions=65)


def test_the_query_prompt_by_name(node):
  url, _, _ = node
  reply = client(url).embeddings.create(model="qwen3-embedding-0.6b", input=TEXTS, extra_body={"prompt_name": "query"})
  assert_reference([d.embedding for d in reply.data], expected("query"))
  with pytest.raises(openai.BadRequestError) as refused:
    client(url).embeddings.create(model="qwen3-embedding-0.6b", input=TEXTS[0], extra_body={"prompt_name": "passage"})
  assert refused.value.body["param"] == "prompt_name" and "query" in refused.value.body["message"]


def test_ollama_client_by_ollamas_name(node):
  url, _, _ = node
  reply = ollama.Client(host=url, timeout=120).embed(model="qwen3-embedding:0.6b", input=TEXTS)
  assert_reference(reply.embeddings, expected("batched"))
  loaded = [m["name"] for m in ollama.Client(host=url, timeout=120).ps().model_dump()["models"]]
  assert "qwen3-embedding-0.6b:latest" in loaded


def test_a_local_checkpoint_by_its_path(node, tmp_path):
  url, _, path = node
  reply = client(url).embeddings.create(model=str(path), input=TEXTS, encoding_format="float")
  assert_reference([d.embedding for d in reply.data], expected("batched"))
  elsewhere = tmp_path / "elsewhere"
  shutil.copytree(path, elsewhere)
  with pytest.raises(openai.BadRequestError, match="not a checkpoint this node serves"):
    client(url).embeddings.create(model=str(elsewhere), input="x")

"""A real exo node pointed at an Ollama-style store (`--models-dir` over it) serves the store's models under Ollama's
names from their GGUF blobs: listed in /v1/models and Ollama's /api/tags, answering as the same GGUF does by its
registry id, with the params layer's stop strings for requests that bring none. A broken manifest or missing blob is
skipped with a log line and the node runs; a model of an architecture no engine runs is refused with the reason."""
import asyncio

import aiohttp
import ollama
import pytest

from tests.support.cluster import Cluster, chat
from tests.support.ollama_store import MODEL, add_gguf_model, add_manifest, write_header_only_gguf

pytestmark = pytest.mark.cluster

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def node(tmp_path_factory, smollm2_path):
  tmp = tmp_path_factory.mktemp("ollama_store")
  store = tmp / "ollama"
  add_gguf_model(store, "library", "smollm2", "135m", smollm2_path, params={"temperature": 0.7})
  add_gguf_model(store, "someone", "smol-stop", "latest", smollm2_path, params={"stop": ["Paris"]})
  add_gguf_model(store, "library", "other", "7b", write_header_only_gguf(tmp / "other.gguf", "gpt2"))
  add_manifest(store, "library", "half-pulled", "latest", [(MODEL, "sha256:" + "cd" * 32)])
  broken = store / "manifests" / "registry.example" / "library" / "broken" / "latest"
  broken.parent.mkdir()
  broken.write_text("{")
  cluster = Cluster(tmp, ["ollama-node"], "numpy", {})
  cluster.nodes["ollama-node"].args += ["--models-dir", str(store), "--max-generate-tokens", "24"]
  try:
    asyncio.run(cluster.start())
    yield cluster
  finally:
    cluster.stop()


async def get_json(url: str, path: str):
  async with aiohttp.ClientSession() as session:
    async with session.get(url + path) as response:
      return response.status, await response.json()


def test_the_stores_models_are_listed_under_ollamas_names(node):
  url = node.url("ollama-node")
  status, listing = asyncio.run(get_json(url, "/v1/models"))
  ids = {m["id"] for m in listing["data"]}
  assert status == 200 and {"smollm2:135m", "someone/smol-stop:latest"} <= ids
  assert not {i for i in ids if "half-pulled" in i or "broken" in i or "other" in i}
  _, tags = asyncio.run(get_json(url, "/api/tags"))
  assert {"smollm2:135m", "someone/smol-stop:latest"} <= {m["name"] for m in tags["models"]}
  log = node.nodes["ollama-node"].log()
  assert "half-pulled:latest" in log and "broken:latest" in log and log.count("skipped") >= 2
  assert "other:7b cannot run here" in log
  assert "smollm2:135m, someone/smol-stop:latest" in log  # what the node serves, said at startup


def test_an_ollama_model_answers_as_its_gguf_does(node):
  url = node.url("ollama-node")
  direct = asyncio.run(chat(url, "smollm2-135m", QUESTION))["choices"][0]["message"]["content"]
  by_name = asyncio.run(chat(url, "smollm2:135m", QUESTION))["choices"][0]["message"]["content"]
  assert by_name == direct and len(direct) > 10
  assert asyncio.run(chat(url, "smollm2:135m", QUESTION, stop=["capital"]))["choices"][0]["message"]["content"] == direct[:direct.index("capital")]


def test_the_ollama_client_lists_it_and_chats_with_it_by_name(node):
  url = node.url("ollama-node")
  direct = asyncio.run(chat(url, "smollm2-135m", QUESTION))["choices"][0]["message"]["content"]
  client = ollama.Client(host=url, timeout=180)
  assert "smollm2:135m" in [m.model for m in client.list().models]
  reply = client.chat(model="smollm2:135m", messages=[{"role": "user", "content": QUESTION}], options={"temperature": 0})
  assert reply.model == "smollm2:135m" and reply.message.content == direct


def test_the_params_layers_stop_strings_hold_unless_a_request_brings_its_own(node):
  url = node.url("ollama-node")
  direct = asyncio.run(chat(url, "smollm2-135m", QUESTION))["choices"][0]["message"]["content"]
  assert "Paris" in direct
  reply = asyncio.run(chat(url, "someone/smol-stop", QUESTION))  # untagged: its :latest
  assert reply["model"] == "someone/smol-stop:latest" and reply["choices"][0]["message"]["content"] == direct[:direct.index("Paris")]
  own = asyncio.run(chat(url, "someone/smol-stop:latest", QUESTION, stop=["zzz"]))["choices"][0]["message"]["content"]
  assert own == direct


async def post_chat(url: str, model: str):
  body = {"model": model, "messages": [{"role": "user", "content": QUESTION}]}
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
      return response.status, await response.json()


def test_an_architecture_no_engine_runs_is_a_clear_400(node):
  status, reply = asyncio.run(post_chat(node.url("ollama-node"), "other:7b"))
  assert status == 400 and "general.architecture is 'gpt2'" in reply["error"]["message"]
  status, _ = asyncio.run(post_chat(node.url("ollama-node"), "smollm2:135m"))
  assert status == 200  # and the node serves on

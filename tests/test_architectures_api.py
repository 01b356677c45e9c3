"""The model families through the HTTP API: a checkpoint transformers 5 wrote answers transformers' tokens, and one
whose config asks for math exo does not compute is refused with a 400 naming the config field."""
import json

import aiohttp
import pytest

from tests.support.api_server import ApiServer
from tests.support.checkpoints import FIXTURE_MODELS, fixture_checkpoint, served_checkpoints

pytestmark = pytest.mark.model

EXPECTED = json.loads((FIXTURE_MODELS / "expected.json").read_text())


@pytest.fixture(scope="module")
def api(tmp_path_factory):
  """A numpy node serving a transformers-5 Llama with llama3 RoPE scaling, the same Llama with a longrope RoPE (not
  implemented), and a Gemma 3 image-and-text model (Gemma3ForConditionalGeneration, transformers 4's form)."""
  root = tmp_path_factory.mktemp("checkpoints")
  scaled = fixture_checkpoint("llama_rope_llama3", root / "llama3")
  longrope = fixture_checkpoint("llama_rope_llama3", root / "longrope")
  config = json.loads((longrope / "config.json").read_text())
  config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 500000.0, "long_factor": [1.0] * 8, "short_factor": [1.0] * 8}
  (longrope / "config.json").write_text(json.dumps(config))
  gemma3 = fixture_checkpoint("gemma3_v4", root / "gemma3")
  with served_checkpoints() as local:
    scaled_id, longrope_id, gemma3_id = local.serve([str(scaled), str(longrope), str(gemma3)], [str(root)])
    server = ApiServer("numpy", default_model=scaled_id).start()
    try:
      yield server, scaled_id, longrope_id, gemma3_id
    finally:
      server.stop()


async def post(url: str, path: str, body: dict):
  async with aiohttp.ClientSession() as session:
    async with session.post(f"{url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=120)) as response:
      return response.status, await response.json()


async def test_a_transformers_5_llama_with_llama3_rope_answers_transformers_tokens(api):
  server, model, _, _ = api
  expected = EXPECTED["llama_rope_llama3"]
  tokenizer = server.call(server.api.core.profiles.get(model))[0]
  assert list(tokenizer.encode(expected["prompt_text"])) == expected["prompt"]
  for prompt in (expected["prompt_text"], expected["prompt"]):
    status, reply = await post(server.url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": len(expected["tokens"]), "temperature": 0})
    assert status == 200, reply
    assert reply["choices"][0]["text"] == tokenizer.decode(expected["tokens"]), prompt


async def test_gemma3s_text_model_answers_transformers_tokens_beside_its_unloaded_vision_tower(api):
  server, _, _, model = api
  expected = EXPECTED["gemma3_v4"]
  status, reply = await post(server.url, "/v1/completions", {"model": model, "prompt": expected["prompt"], "max_tokens": len(expected["tokens"]),
                                                              "temperature": 0})
  assert status == 200, reply
  tokenizer = server.call(server.api.core.profiles.get(model))[0]
  assert reply["choices"][0]["text"] == tokenizer.decode(expected["tokens"])


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})])
async def test_an_unimplemented_rope_type_answers_400_naming_the_field(api, path, body):
  server, _, longrope, _ = api
  status, reply = await post(server.url, path, {"model": longrope, **body})
  assert status == 400, reply
  assert reply["error"]["param"] == "model" and "rope_parameters.rope_type" in reply["error"]["message"] and "longrope" in reply["error"]["message"], reply

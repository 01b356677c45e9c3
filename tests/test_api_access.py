"""Browser safety and the API key over real HTTP: a page from a foreign origin cannot stop the node, delete model
files or start a download; a "simple" text/plain post reaches no handler; CORS only for allowed origins and never
with credentials; the node's own origins and EXO_ALLOWED_ORIGINS; Bearer keys."""
import json

import aiohttp
import openai
import pytest

from exo.api.settings import ApiSettings

pytestmark = pytest.mark.unit

USER = [{"role": "user", "content": "hello"}]
EVIL = "http://evil.test"


async def request(method, url, body=None, headers=None, content_type="application/json"):
  async with aiohttp.ClientSession() as session:
    data = None if body is None else (body if isinstance(body, str) else json.dumps(body))
    all_headers = {**({"Content-Type": content_type} if data is not None else {}), **(headers or {})}
    async with session.request(method, url, data=data, headers=all_headers) as r:
      return r.status, r.headers, await r.text()


def error(status, headers, text):
  return status, json.loads(text)["error"]


@pytest.mark.asyncio
async def test_a_foreign_page_cannot_quit_the_node(make_server):
  s = make_server("dummy")
  for content_type in ("text/plain", "application/json"):
    status, e = error(*await request("POST", f"{s.url}/quit", "{}", {"Origin": EVIL}, content_type))
    assert status == 403 and e["code"] == "origin_not_allowed" and EVIL in e["message"]
  # A "simple" post without an Origin (or from the node's own page) but not JSON does not reach /quit either.
  status, e = error(*await request("POST", f"{s.url}/quit", "stop", content_type="text/plain"))
  assert status == 415 and e["param"] == "Content-Type"
  assert not s.quit_requested.is_set()
  assert (await request("GET", f"{s.url}/healthcheck"))[0] == 200
  status, _, text = await request("POST", f"{s.url}/quit", {}, {"Origin": f"http://127.0.0.1:{s.port}"})
  assert (status, text) == (200, '{"detail": "Quit signal received"}') and s.quit_requested.wait(5)


@pytest.mark.asyncio
async def test_a_foreign_page_cannot_delete_files_or_start_a_download(make_server, tmp_path, monkeypatch):
  monkeypatch.setenv("EXO_HOME", str(tmp_path))
  files = tmp_path / "downloads" / "dummy"
  files.mkdir(parents=True)
  (files / "weights.bin").write_bytes(b"precious")
  s = make_server("dummy")
  status, e = error(*await request("DELETE", f"{s.url}/models/dummy", headers={"Origin": EVIL}))
  assert status == 403 and (files / "weights.bin").read_bytes() == b"precious"
  status, e = error(*await request("POST", f"{s.url}/download", {"model": "dummy"}, {"Origin": EVIL}))
  assert status == 403 and e["code"] == "origin_not_allowed"
  status, e = error(*await request("POST", f"{s.url}/v1/chat/completions", {"messages": USER}, {"Origin": EVIL}))
  assert status == 403
  status, _, text = await request("DELETE", f"{s.url}/models/dummy")  # a program (no Origin) may
  assert status == 200 and not files.exists()


@pytest.mark.asyncio
async def test_own_origins_and_the_allowlist(make_server):
  s = make_server("dummy", settings=ApiSettings(allowed_origins=("http://ui.example:3000", "https://*.corp.test")))
  url = f"{s.url}/v1/chat/completions"
  for origin in (f"http://127.0.0.1:{s.port}", f"http://localhost:{s.port}", f"http://[::1]:{s.port}", "http://ui.example:3000",
                 "https://chat.corp.test"):
    status, headers, _ = await request("POST", url, {"messages": USER}, {"Origin": origin})
    assert status == 200, origin
    assert headers["Access-Control-Allow-Origin"] == origin and "Access-Control-Allow-Credentials" not in headers
  # Another port on this machine, a look-alike, DNS rebinding (a foreign name resolving to this node), `null`.
  for origin in ("http://127.0.0.1:1", "http://ui.example:3001", "http://chat.corp.test", f"http://evil.test:{s.port}", "null"):
    status, headers, _ = await request("POST", url, {"messages": USER}, {"Origin": origin, "Host": f"evil.test:{s.port}"})
    assert status == 403 and "Access-Control-Allow-Origin" not in headers, origin


@pytest.mark.asyncio
async def test_cors_only_for_allowed_origins_never_with_credentials(make_server):
  s = make_server("dummy", settings=ApiSettings(allowed_origins=("http://ui.example:3000",)))
  allowed = {"Origin": "http://ui.example:3000"}
  _, headers, _ = await request("GET", f"{s.url}/v1/models", headers=allowed)
  assert headers["Access-Control-Allow-Origin"] == "http://ui.example:3000" and "Origin" in headers["Vary"]
  assert "Access-Control-Allow-Credentials" not in headers
  status, headers, _ = await request("POST", f"{s.url}/v1/chat/completions", {"messages": USER, "temperature": 9}, allowed)
  assert status == 400 and headers["Access-Control-Allow-Origin"] == "http://ui.example:3000"  # errors are readable too
  _, headers, _ = await request("GET", f"{s.url}/v1/models", headers={"Origin": EVIL})
  assert "Access-Control-Allow-Origin" not in headers
  _, headers, _ = await request("GET", f"{s.url}/index.js", headers=allowed)
  assert "Access-Control-Allow-Origin" not in headers  # static files: same-origin only
  preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
  status, headers, _ = await request("OPTIONS", f"{s.url}/v1/chat/completions", headers={**allowed, **preflight})
  assert status == 204 and headers["Access-Control-Allow-Origin"] == "http://ui.example:3000"
  assert headers["Access-Control-Allow-Methods"] == "POST" and headers["Access-Control-Allow-Headers"] == "authorization,content-type"
  assert "Access-Control-Allow-Credentials" not in headers
  status, headers, _ = await request("OPTIONS", f"{s.url}/quit", headers={"Origin": EVIL, **preflight})
  assert status == 403 and "Access-Control-Allow-Origin" not in headers
  s_any = make_server("dummy", settings=ApiSettings(allowed_origins=("*",)))
  assert (await request("POST", f"{s_any.url}/v1/chat/completions", {"messages": USER}, {"Origin": EVIL}))[0] == 200


@pytest.mark.asyncio
async def test_api_key(make_server):
  s = make_server("dummy", settings=ApiSettings(api_key="sekrit"))
  for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
    status, response_headers, text = await request("POST", f"{s.url}/v1/chat/completions", {"messages": USER}, headers)
    assert status == 401 and response_headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(text)["error"]["type"] == "authentication_error" and json.loads(text)["error"]["code"] == "invalid_api_key"
  for path in ("/v1/models", "/v1/topology", "/metrics", "/modelpool"):
    assert (await request("GET", f"{s.url}{path}"))[0] == 401, path
  for path in ("/healthcheck", "/health", "/", "/index.js"):  # probes and the tinychat page itself need no key
    assert (await request("GET", f"{s.url}{path}"))[0] == 200, path
  assert (await request("OPTIONS", f"{s.url}/v1/chat/completions", headers={"Origin": f"http://127.0.0.1:{s.port}",
                                                                              "Access-Control-Request-Method": "POST"}))[0] == 204
  client = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="sekrit", max_retries=0)
  reply = await client.chat.completions.create(model="dummy", messages=USER)
  assert reply.choices[0].message.content == "dummy" * 10
  await client.close()
  client = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="nope", max_retries=0)
  with pytest.raises(openai.AuthenticationError):
    await client.chat.completions.create(model="dummy", messages=USER)
  await client.close()

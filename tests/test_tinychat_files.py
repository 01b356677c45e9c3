"""tinychat's files as the node serves them: each with its content type and no CORS header, and none fetching
anything from a third party at run time (the page works on a machine with no internet)."""
import re
from pathlib import Path

import aiohttp
import pytest

from tests.support.api_server import shared_server

pytestmark = pytest.mark.unit

TINYCHAT = Path(__file__).resolve().parent.parent / "exo" / "tinychat"


@pytest.mark.asyncio
async def test_static_files_are_served_without_cors():
  server = shared_server("dummy")
  expected = {"/": "text/html", "/index.js": "text/javascript", "/index.css": "text/css", "/favicon.svg": "image/svg+xml"}
  async with aiohttp.ClientSession() as session:
    for path, content_type in expected.items():
      async with session.get(f"{server.url}{path}", headers={"Origin": "http://elsewhere.test"}) as r:
        assert r.status == 200 and r.content_type in (content_type, "application/javascript"), (path, r.content_type)
        assert "Access-Control-Allow-Origin" not in r.headers
    async with session.get(f"{server.url}/") as r:
      assert '<script src="/index.js"></script>' in await r.text()


def test_no_third_party_fetches_at_run_time():
  for path in TINYCHAT.rglob("*"):
    if path.is_file() and path.suffix in (".html", ".js", ".css", ".svg"):
      urls = set(re.findall(r"https?://[^\s\"')]+", path.read_text())) - {"http://www.w3.org/2000/svg"}
      assert not urls, f"{path.name} refers to {urls}"

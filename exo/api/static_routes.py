"""The tinychat web page's files, and the images upstream's image routes would write, served as files."""
from pathlib import Path

from aiohttp import web

from exo.api.errors import ApiError

TINYCHAT_DIR = Path(__file__).resolve().parent.parent / "tinychat"
IMAGES_DIR = Path.home() / "Documents" / "Exo" / "Images"


async def handle_static(request: web.Request) -> web.FileResponse:
  """tinychat's files; `/` is its page."""
  return _file_in(TINYCHAT_DIR, request.match_info["path"] or "index.html", request)


async def handle_image_file(request: web.Request) -> web.FileResponse:
  return _file_in(IMAGES_DIR, request.match_info["file_name"], request)


def add_static_routes(app: web.Application) -> None:
  """Last: the tinychat route claims every other path for GET."""
  app.router.add_get("/images/{file_name}", handle_image_file)
  app.router.add_get("/{path:.*}", handle_static)


def is_static(request: web.Request) -> bool:
  return request.match_info.route.handler in (handle_static, handle_image_file)


def _file_in(folder: Path, name: str, request: web.Request) -> web.FileResponse:
  path = (folder / name).resolve()
  if not path.is_relative_to(folder.resolve()) or not path.is_file():
    raise ApiError(404, f"nothing here: {request.method} {request.path}", code="not_found")
  return web.FileResponse(path)

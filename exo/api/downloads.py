"""How the API answers about downloads: a failed download as the reply to the requests that waited for it, and
this node's downloads (GET /v1/downloads)."""
from typing import Optional

from exo.api.errors import ApiError
from exo.download.errors import DownloadError


def download_api_error(error: DownloadError) -> ApiError:
  """A failed download's reply: its status (5xx, never 500: see exo/download/errors.py), message and kind as `code`."""
  return ApiError(error.status, error.message, param="model", code=error.kind)


def peer_download_api_error(message: str) -> Optional[ApiError]:
  """The reply for a request that failed on another node because that node's download failed (its request_error
  carries the error's message); None for any other failure."""
  error = DownloadError.from_message(message)
  return None if error is None else download_api_error(error)


def downloads_view(downloader) -> dict:
  """GET /v1/downloads: this node's downloads since it started, by model (see HFShardDownloader.downloads); {} for
  a downloader that never downloads (the dummy engine's)."""
  downloads = getattr(downloader, "downloads", None)
  return downloads() if downloads is not None else {}

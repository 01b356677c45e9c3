"""API errors, answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

A handler raises ApiError wherever it finds the problem; the API's error middleware turns it into the reply (and
a stream already under way into a final error event)."""
from typing import Dict, Optional

# The `type` OpenAI's clients read, by status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
               501: "not_implemented_error", 503: "unavailable_error", 504: "timeout_error"}


class ApiError(Exception):
  """The reply to a request that cannot be served: its status, a message saying why, the request field at fault."""

  def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               headers: Optional[Dict[str, str]] = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}

  @property
  def type(self) -> str:
    return ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class BadRequest(ApiError):
  """The client's mistake in a field of its request (HTTP 400)."""

  def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None):
    super().__init__(400, message, param, code)

"""RequestError: a request the router refused or could not answer, with the status and
the fields the APIs' error bodies carry. Raised by the APIs' checks, by the manager (the
server is starting, draining, or lost the request's replica) and by the scheduler's
answers; the HTTP server turns it into OpenAI's or Anthropic's error body, the SDK's
front door into a ClientError."""

from __future__ import annotations

import math


class RequestError(Exception):
    """A request the system refused; carries the OpenAI error fields (`param`: the
    request's field at fault, as the client named it) and HTTP headers."""

    def __init__(
        self,
        message: str,
        code: str = "invalid_request_error",
        status: int = 400,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.message, self.code, self.status = message, code, status
        self.headers, self.param = headers, param


def unavailable(message: str, retry_after: float | None = None) -> RequestError:
    headers = {"Retry-After": str(math.ceil(retry_after))} if retry_after else None
    return RequestError(message, "service_unavailable", 503, headers)

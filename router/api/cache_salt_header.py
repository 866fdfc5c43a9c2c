"""`--cache-salt-header NAME`: the cache salt a gateway in front of the server sets.

A gateway that authenticates tenants puts each one's salt in a header, so tenants share
cached prefixes only among themselves whatever their bodies say: the header, when the
request has it, overrides the body's `cache_salt` (an empty header value is the shared
cache). A middleware notes the header's value for the request being handled, and every
endpoint's generation (`request_salt`) reads it, as `router.api.access_log` counts usage.
"""

from __future__ import annotations

import contextvars

from common.cache_salt import salt_problem
from router.replicas.manager import RequestError

_gateway_salt: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "gateway_salt", default=None
)
_header_name: contextvars.ContextVar[str] = contextvars.ContextVar("salt_header", default="")


class SaltHeader:
    """Pure ASGI middleware: the header's value (latin-1, as HTTP carries it) for the
    request, or None when the request has no such header."""

    def __init__(self, app, header: str):
        self.app, self.header = app, header
        self.key = header.lower().encode("latin-1")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        value = next((v for k, v in scope["headers"] if k == self.key), None)
        salt = _gateway_salt.set(None if value is None else value.decode("latin-1"))
        name = _header_name.set(self.header)
        try:
            await self.app(scope, receive, send)
        finally:  # a connection's next request runs in the same task: leave nothing behind
            _gateway_salt.reset(salt)
            _header_name.reset(name)


def request_salt(body_salt: str | None) -> str:
    """The salt the current request runs under: the gateway's header if it was sent,
    else the body's `cache_salt` (checked when the body was parsed); "" for none."""
    salt = _gateway_salt.get()
    if salt is None:
        return body_salt or ""
    problem = salt_problem(salt) if salt else None
    if problem:
        raise RequestError(f"{_header_name.get()} header: {problem}", param="cache_salt")
    return salt

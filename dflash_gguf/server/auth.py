"""The API key guard: `Authorization: Bearer KEY` or `x-api-key: KEY`, compared in constant time.

GET /health and / stay open (load balancers and launchers probe the one; Claude Code sends `HEAD /` before its
first request, and takes a 401 there as the server's refusal); every other path needs the key.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response

OPEN_PATHS = frozenset({"/health", "/"})


def presented_key(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            return value[7:].strip()
    for name, value in headers:
        if name == b"x-api-key":
            return value.strip()
    return None


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        key = presented_key(scope.get("headers", []))
        if key is None or not hmac.compare_digest(key, self._key):
            message = "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'" if key is None \
                else "invalid API key"
            response = error_response(401, message, None, "invalid_api_key", path=scope["path"],
                                      headers={"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

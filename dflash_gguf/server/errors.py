"""One error shape for every failure: {"error": {"message", "type", "param", "code"}}, never a traceback.

The Anthropic route's errors carry the same object plus Anthropic's top-level `"type": "error"`, so
both SDKs read them.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .fields import renames

log = logging.getLogger("dflash_gguf.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class APIError(Exception):
    """A refusal with its HTTP status, raised anywhere in a route and answered in the error shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}


def cancelled() -> APIError:
    """The one refusal of a generation the server stopped before its end (it is shutting down)."""
    return APIError(503, "the generation was cancelled (the server is shutting down)", code="cancelled")


@dataclass(frozen=True)
class Terms:
    """How one protocol names the chat request's fields: its rename table, chat-request path -> its own path.

    A generation setting is named by the protocol's field for it (fields.FIELDS, declared once: `top_k` ->
    whatever the protocol calls it); then `rules`, (pattern, replacement) regular expressions on a dotted path,
    the first that matches applied.
    A request whose messages do not map one for one onto the chat's (Anthropic's tool_result blocks become
    tool messages, Responses items become turns) gives `origins` with its Job: the chat path of a message
    or of one of its calls (`messages.3`, `messages.3.tool_calls.1`) -> the request's own (`input.5`); the
    rest of the path is then named by `rules` too."""

    protocol: str
    rules: tuple[tuple[str, str], ...] = ()

    def name(self, param: str, origins: Mapping[str, str] | None = None) -> str:
        for prefix in sorted(origins or {}, key=len, reverse=True):
            if param == prefix or param.startswith(prefix + "."):
                param = origins[prefix] + "\0" + param[len(prefix):]  # \0: where the origin ends
                break
        spelled = tuple((rf"^{re.escape(setting)}(?=\.|$)", name) for setting, name in renames(self.protocol).items())
        for pattern, replacement in spelled + self.rules:
            renamed, n = re.subn(pattern, replacement, param, count=1)
            if n:
                param = renamed
                break
        return param.replace("\0", "")

    @contextlib.contextmanager
    def speaking(self, origins: Mapping[str, str] | None = None) -> Iterator[None]:
        """An APIError raised inside, with its param (and the message's leading field) in this protocol's terms."""
        try:
            yield
        except APIError as e:
            if e.param is not None:
                old, e.param = e.param, self.name(e.param, origins)
                if e.message.startswith(old + ":"):
                    e.message = e.param + e.message[len(old):]
            raise


def error_body(status: int, message: str, param: str | None = None, code: str | None = None, *,
               anthropic: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param, "code": code}
    }
    return {"type": "error", **body} if anthropic else body


def error_response(status: int, message: str, param: str | None = None, code: str | None = None, *,
                   headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    anthropic = path.startswith("/v1/messages")
    return JSONResponse(error_body(status, message, param, code, anthropic=anthropic), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for the first validation error, naming the field as a dotted path."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg', ''))}", None
    # pydantic puts the union member's name in the path (e.g. messages.0.ChatCompletionRequestUserMessage.content)
    loc = [x for x in loc if not x[:1].isupper()]
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    if e.get("type") == "extra_forbidden":
        msg = "not a field dflash-serve knows (it acts on or refuses every field it takes, and drops none)"
    return (f"{param}: {msg}" if param else f"invalid request body: {msg}"), param


def install(app: FastAPI) -> None:
    """Answer every failure in the error shape; unexpected exceptions are logged here, not sent."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _log_refusal(request, exc.status, exc.message)
        return error_response(exc.status, exc.message, exc.param, exc.code, headers=exc.headers, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and "json" not in content_type.lower():
            # not parsed on purpose: a web page can send text/plain to localhost without a CORS preflight
            return error_response(400, f"the body must be JSON sent with 'Content-Type: application/json' "
                                  f"(got {content_type or 'no Content-Type'})", None, "invalid_content_type",
                                  path=request.url.path)
        message, param = validation_message(exc)
        _log_refusal(request, 400, message)
        unknown = any(e.get("type") == "extra_forbidden" for e in exc.errors()[:1])
        code = "unsupported_parameter" if unknown else "invalid_value" if param else "invalid_body"
        return error_response(400, message, param, code, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = f"no route {request.method} {request.url.path}" if status in (404, 405) else str(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(status)
        return error_response(status, message, None, code, headers=getattr(exc, "headers", None), path=request.url.path)

    def _log_refusal(request: Request, status: int, message: str) -> None:
        """One line per refused request, at the level the server logs by default (4xx: the client's doing)."""
        if status < 500:
            log.warning("refused %s %s: %d %s", request.method, request.url.path, status, message.splitlines()[0][:300])

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(exc).__name__}); the server logged it", None,
                              "internal_error", path=request.url.path)

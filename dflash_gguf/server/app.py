"""The FastAPI app: routes, guards (API key, body size), the error shape, metrics, and a clean shutdown.

create_app takes Sessions already opened (one per slot) and does not close them: their owner (the CLI,
a test fixture) does, after the server has stopped. Run it with serving.Server: as soon as uvicorn
begins to stop, queued and new requests get 503 and streams end at their next cycle; non-streamed
replies may finish within uvicorn's graceful timeout, then the lifespan cancels what is left and waits
for the slot threads to let go.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Sequence

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..session import Session
from . import anthropic_routes, errors, openai_routes, responses_routes
from .auth import APIKeyMiddleware
from .config import ServerConfig
from .engine import Engine
from .limits import BodyLimitMiddleware
from .metrics import Metrics

log = logging.getLogger("dflash_gguf.server")
SHUTDOWN_DRAIN_S = 10.0


class CountRequests:
    """Counts every answered request by route and status, whatever answered it (guards included)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(scope["path"], message["status"])
            await send(message)

        await self.app(scope, receive, counting)


def create_app(sessions: Sequence[Session], config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    metrics = Metrics()
    engine = Engine(list(sessions), config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.begin_shutdown()  # already called by serving.Server when uvicorn began to stop
        engine.cancel_all()
        if not await engine.drain(SHUTDOWN_DRAIN_S):
            log.warning("a generation did not stop within %.0f s of shutdown", SHUTDOWN_DRAIN_S)

    app = FastAPI(title="dflash-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    errors.install(app)
    app.include_router(openai_routes.router(engine))
    app.include_router(anthropic_routes.router(engine))
    app.include_router(responses_routes.router(engine))

    # where the slots' layers are, read while the Sessions are open (every slot opens with the same options)
    where = engine.placement

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> JSONResponse:
        """What a client probing the server's address finds (Claude Code sends HEAD / first): where the API is."""
        return JSONResponse({"name": "dflash-serve", "api": "/v1", "health": "/health"})

    @app.get("/health")
    async def health() -> JSONResponse:
        pool = engine.pool
        body = {"status": "shutting_down" if pool.closing else "ok", "slots": len(pool.slots),
                "slots_idle": len(pool.slots) - pool.busy, "queue_depth": pool.queue_depth,
                "backend": where.backend, "device": where.device}
        return JSONResponse(body, status_code=503 if pool.closing else 200)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        pool = engine.pool
        text = metrics.render(queue_depth=pool.queue_depth, slots_busy=pool.busy, slots=len(pool.slots))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # outermost first: count, then the key, then the body limit
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(CountRequests, metrics=metrics)
    return app

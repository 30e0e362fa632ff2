"""`dflash-serve`: an OpenAI- and Anthropic-compatible HTTP server over Sessions, one Session per slot.

Rooms: `config` (the settings), `schemas` (request models, built on llama_cpp.server's), `errors` (the one
error shape), `auth` and `limits` (ASGI guards), `slots` (the slot pool and its FIFO queue), `worker`
(a generation in a thread, Steps handed to the event loop), `engine` (a request to a running generation:
tokens, context check, queue, disconnect watch), `timings` (per-response figures from the stats model),
`metrics` (Prometheus text), `sse` (streams that end cleanly on shutdown), `serving` (the uvicorn server
that refuses work with 503 as soon as it begins to stop), `openai_routes`,
`anthropic_routes`, `app` and `cli`.
"""

from .config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def create_app(*args, **kwargs):
    """The FastAPI app over already opened Sessions (see app.create_app)."""
    from .app import create_app as _create_app

    return _create_app(*args, **kwargs)

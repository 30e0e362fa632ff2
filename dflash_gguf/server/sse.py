"""The SSE response for a Run: on server shutdown its generation is cancelled at the next cycle, so the
stream ends with its own closing events (an error event, then [DONE] for OpenAI) instead of being cut."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import anyio
from sse_starlette.sse import EventSourceResponse

from .engine import Run

PING_S = 15
SHUTDOWN_GRACE_S = 5.0


def stream_response(run: Run, events: AsyncIterator[dict[str, Any]]) -> EventSourceResponse:
    shutdown = anyio.Event()

    async def cancel_on_shutdown() -> None:
        await shutdown.wait()
        run.cancel()

    watcher = asyncio.ensure_future(cancel_on_shutdown())
    run.generation_done_callbacks.append(watcher.cancel)
    return EventSourceResponse(events, ping=PING_S, shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)

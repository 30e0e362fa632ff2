"""The SSE response for a Run: on server shutdown its generation is cancelled at the next cycle, so the
stream ends with its own closing events (an error event, then [DONE] for OpenAI) instead of being cut."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, TypeVar

import anyio
from sse_starlette.sse import EventSourceResponse

from .engine import Run

SHUTDOWN_GRACE_S = 5.0
T = TypeVar("T")


async def heartbeat(events: AsyncIterator[T], every: float) -> AsyncIterator[T | None]:
    """The events, with a None after each `every` seconds without one: a stream then sends its protocol's
    own keep-alive event. Claude Code and Codex drop a stream after 300 s without an event (SSE comments do
    not count), and a wait in the queue, a long cold prefill, or a tool call held back until it is whole,
    can take longer."""
    source = events.__aiter__()
    pending = asyncio.ensure_future(source.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(source.__anext__())
    finally:
        pending.cancel()


def stream_response(run: Run, events: AsyncIterator[dict[str, Any]]) -> EventSourceResponse:
    shutdown = anyio.Event()

    async def cancel_on_shutdown() -> None:
        await shutdown.wait()
        run.cancel()

    watcher = asyncio.ensure_future(cancel_on_shutdown())
    run.generation_done_callbacks.append(watcher.cancel)
    return EventSourceResponse(events, ping=run.keepalive_s, shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_S)

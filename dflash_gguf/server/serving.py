"""The uvicorn server dflash-serve runs (and the tests run): uvicorn's, with the shutdown it needs.

Two changes: the moment uvicorn begins to stop (a signal, or should_exit set by an embedding program),
the app's engine refuses queued and new work with 503 and ends its streams cleanly, before uvicorn waits
for connections to finish; and SIGINT/SIGTERM are not re-raised once the shutdown is done, so the caller
closes the Sessions in order and the process exits with status 0.

On a signal the engine is told at once, on the loop's next turn: sse-starlette ends every stream as soon
as it sees the signal too, and a stream that ends frees its slot, which a queued request must not get.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from typing import Any, Iterator

import uvicorn


class Server(uvicorn.Server):
    _loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_shutdown)
        super().handle_exit(sig, frame)

    def _begin_shutdown(self) -> None:
        engine = getattr(getattr(self.config.app, "state", None), "engine", None)
        if engine is not None:
            engine.begin_shutdown()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread: an embedding program stops us with should_exit
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        self._begin_shutdown()
        await super().shutdown(sockets=sockets)

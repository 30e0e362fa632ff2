"""A generation in its own thread: the Session's Steps are handed to the event loop as they come.

The thread owns the Session for the whole generation; the slot is released (on the loop) only once
the thread is done with it. cancel() stops the generation at the next cycle: the Session's stream is
closed between two Steps, where its caches are consistent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from ..session import Session
from ..stats import GenerationStats
from ..steps import Step
from .slots import Slot, SlotPool


@dataclass
class Outcome:
    """How a generation ended: stats when it ran to its end, error when the Session raised."""

    stats: GenerationStats | None = None
    error: BaseException | None = None
    cancelled: bool = False


class Generation:
    def __init__(self, pool: SlotPool, slot: Slot, start: Callable[[Session], Iterator[Step]]) -> None:
        self.pool, self.slot, self._start = pool, slot, start
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Step | Outcome] = asyncio.Queue()
        self._cancel = threading.Event()
        self.done = asyncio.Event()  # set once the slot is released
        self._thread = threading.Thread(target=self._run, name=f"dflash-slot-{slot.id}", daemon=True)
        self.started = time.perf_counter()

    def start(self) -> "Generation":
        self._thread.start()
        return self

    def cancel(self) -> None:
        self._cancel.set()
        self.slot.ending = True  # a retry of this request waits for the slot instead of prefilling it again

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    async def events(self) -> AsyncIterator[Step | Outcome]:
        """Every Step, then one Outcome."""
        while True:
            event = await self._events.get()
            yield event
            if isinstance(event, Outcome):
                return

    def _post(self, event: Step) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:
            pass  # the loop is gone (shutdown): nobody is listening

    def _run(self) -> None:
        outcome = Outcome()
        steps: Iterator[Step] | None = None
        try:
            if not self._cancel.is_set():
                steps = self._start(self.slot.session)
                for step in steps:
                    self._post(step)
                    if self._cancel.is_set():
                        break
            if self._cancel.is_set():
                outcome.cancelled = True
            else:
                outcome.stats = self.slot.session.last_stats
        except BaseException as e:  # handed to the route, which answers in the error shape
            outcome.error = e
        finally:
            if steps is not None and hasattr(steps, "close"):
                steps.close()  # ends the Session's generation (and its lock) here, in this thread
            try:
                self._loop.call_soon_threadsafe(self._end, outcome)
            except RuntimeError:  # the loop is gone (shutdown): nobody is listening
                self.slot.busy = False

    def _end(self, outcome: Outcome) -> None:
        """Release the slot, then hand over the Outcome: a client that has its answer finds the slot (and
        the conversation its Session holds) free for its next turn."""
        self.pool.release(self.slot, time.perf_counter() - self.started)
        self.done.set()
        self._events.put_nowait(outcome)

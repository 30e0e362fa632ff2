"""The slot pool: one Session per slot, a bounded FIFO of waiting requests, prefix-aware routing.

Runs on the event loop only (no locks): a request is admitted at once (admit() returns its ticket): it
takes a free slot when nobody waits, otherwise joins the queue, or is refused there and then, 429 when the
queue is full (503 once the server is closing). Waiting for the ticket is the caller's, so that a stream
can begin (its headers and first events) while it waits.
Among free slots it takes the one whose cached tokens its prompt extends the most, so that a
multi-turn chat keeps landing on the slot that holds its KV; ties go to the least recently used.
Where the slots are sequences of one context (--batch-slots), a request with no home among the free
slots takes one next to the busy sequences first: libllama decodes their batch in one pass per run of
consecutive sequence ids, so busy slots 0, 1, 2 decode in one pass and 0, 2, 5 in three.
A slot's cached tokens are its Session's committed tokens, read where the Session holds them.

A slot that frees while requests wait goes to the earliest waiter whose conversation lives there (its
prompt shares at least AFFINITY_MARGIN more tokens with that slot's cache than with any other slot's);
failing that, to the earliest waiter with no such home elsewhere; failing that, to the queue's head.
So a queued follow-up turn waits for its own slot only while others can use the one that freed, and
a slot never idles while anyone waits.

A retry joins the prefill it repeats: a request whose home is a busy slot whose client has left (its
generation is cancelled and ends at its next cycle, after the prefill in progress) waits for that slot
rather than prefilling the same prompt again on a free one, and finds it cached there. Such a waiter never
holds back anyone else: free slots stay free for the others.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from ..batching import SequenceTarget
from ..decoding import shared_prefix
from ..session import Session
from .errors import APIError

AFFINITY_MARGIN = 16  # prompt tokens a slot's cache must share beyond any other slot's to be a request's home

@dataclass(eq=False)
class Slot:
    id: int
    session: Session
    last_used: float = 0.0
    busy: bool = False
    ending: bool = False  # busy with a cancelled generation (its client left): free after its current cycle
    prompt: Sequence[int] = ()  # the prompt of the generation it runs (it holds it once prefilled)

    @property
    def cached(self) -> Sequence[int]:
        """The tokens its Session's context holds (a view, not a copy; a busy slot's change as it decodes)."""
        return self.session.committed_tokens

    def shared_prefix(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` its cache holds, or will hold once the prompt it is prefilling is in."""
        return max(shared_prefix(self.cached, tokens), shared_prefix(self.prompt, tokens))


@dataclass(eq=False)
class _Waiter:
    tokens: Sequence[int]
    future: asyncio.Future
    home_only: bool = False  # waits for its home slot only (a retry of the prefill running there)


class SlotPool:
    def __init__(self, sessions: Sequence[Session], max_queue: int) -> None:
        if not sessions:
            raise ValueError("the pool needs at least one Session")
        self.slots = [Slot(i, s) for i, s in enumerate(sessions)]
        # each slot's sequence id where the slots are sequences of one context (the module says why it matters)
        targets = [s.target for s in sessions]
        self._seq = ({slot.id: t.seq_id for slot, t in zip(self.slots, targets)}
                     if all(isinstance(t, SequenceTarget) for t in targets) else None)
        self.max_queue = max_queue
        self._waiting: deque[_Waiter] = deque()
        self.closing = False
        self._durations: deque[float] = deque(maxlen=32)  # recent request times, for Retry-After

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> int:
        return sum(s.busy for s in self.slots)

    def retry_after(self) -> int:
        """Seconds until a queued request would likely start: the queue drained at the recent pace."""
        mean = sum(self._durations) / len(self._durations) if self._durations else 1.0
        return max(1, math.ceil(mean * (len(self._waiting) + 1) / len(self.slots)))

    def admit(self, tokens: Sequence[int]) -> asyncio.Future[Slot]:
        """A ticket for a slot, decided now: done at once with a free slot, or a place in the queue that a freed
        slot settles later. Refused at once (429 when the queue is full, 503 once the server is closing), so a
        refusal is still an HTTP status while a queued request's stream has already begun."""
        if self.closing:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        ticket: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        free = [s for s in self.slots if not s.busy]
        home = self.home(tokens)
        joins = home is not None and home.busy and home.ending
        if free and not joins and all(w.home_only for w in self._waiting):
            ticket.set_result(self._take(self._pick(free, tokens, home)))
            return ticket
        if len(self._waiting) >= self.max_queue:
            raise APIError(429, f"all {len(self.slots)} slots are busy and {len(self._waiting)} requests are "
                           "waiting (the queue is full); retry later", code="queue_full",
                           headers={"Retry-After": str(self.retry_after())})
        self._waiting.append(_Waiter(tokens, ticket, home_only=joins))
        return ticket

    def _pick(self, free: list[Slot], tokens: Sequence[int], home: Slot | None) -> Slot:
        """The free slot a request takes: its home; else, on a shared context, one next to busy sequences
        (filling a gap first); then the longest cached prefix, then the least recently used."""
        if home is not None and not home.busy:
            return home
        return max(free, key=lambda s: (self._busy_neighbours(s), s.shared_prefix(tokens), -s.last_used))

    def _busy_neighbours(self, slot: Slot) -> int:
        """Busy slots whose sequence ids are next to this slot's (0 where the slots have contexts of their own)."""
        if self._seq is None:
            return 0
        seq = self._seq[slot.id]
        return sum(1 for s in self.slots if s.busy and abs(self._seq[s.id] - seq) == 1)

    def withdraw(self, ticket: asyncio.Future[Slot]) -> bool:
        """The request is gone before its generation began: its place in the queue is given up, or the slot it
        was just handed is passed on. False when there was nothing to give up (refused, or withdrawn before)."""
        self._waiting = deque(w for w in self._waiting if w.future is not ticket)
        if ticket.cancel():
            return True
        if ticket.cancelled() or ticket.exception() is not None:
            return False
        self.release(ticket.result())
        return True

    async def acquire(self, tokens: Sequence[int]) -> Slot:
        """admit(), then wait for the slot; a caller cancelled while waiting gives its place up."""
        ticket = self.admit(tokens)
        try:
            return await asyncio.shield(ticket)
        except asyncio.CancelledError:
            self.withdraw(ticket)
            raise

    def _take(self, slot: Slot) -> Slot:
        slot.busy = True
        slot.ending = False
        return slot

    def release(self, slot: Slot, duration_s: float | None = None) -> None:
        """The slot's generation has ended (its thread is done with the Session): hand it on."""
        if duration_s is not None:
            self._durations.append(duration_s)
        slot.last_used = time.monotonic()
        slot.busy = False
        slot.prompt = ()
        self._waiting = deque(w for w in self._waiting if not w.future.done())  # clients gone while queued
        for w in self._waiting:  # a retry whose home is no longer a slot about to free waits like anyone else
            if w.home_only:
                home = self.home(w.tokens)
                w.home_only = home is not None and home.busy and home.ending
        waiter = self._next_for(slot) if self._waiting else None
        if waiter is not None:
            self._waiting.remove(waiter)
            waiter.future.set_result(self._take(slot))

    def home(self, tokens: Sequence[int]) -> Slot | None:
        """The slot whose cache this prompt extends by AFFINITY_MARGIN tokens more than any other's, if one does."""
        if len(self.slots) < 2:
            return None
        ranked = sorted(self.slots, key=lambda s: s.shared_prefix(tokens), reverse=True)
        first, second = ranked[0].shared_prefix(tokens), ranked[1].shared_prefix(tokens)
        return ranked[0] if first - second >= AFFINITY_MARGIN else None

    def _next_for(self, slot: Slot) -> _Waiter | None:
        """Who gets a freed slot: its own conversation first, then a waiter not tied elsewhere, then the first
        that is not waiting for its home slot only (None: the slot stays free)."""
        homes = [self.home(w.tokens) for w in self._waiting]
        for want in (slot, None):
            for waiter, home in zip(self._waiting, homes):
                if home is want and (not waiter.home_only or home is slot):
                    return waiter
        return next((w for w in self._waiting if not w.home_only), None)

    def close(self) -> None:
        """Refuse new requests and every waiting one with 503; running generations are the app's to cancel."""
        self.closing = True
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(
                    APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"}))

"""The worker-thread side of the chat: Session calls run here, results go back as posted messages.

One Session call at a time (a lock), because a reply and a calibration share the Session's KV caches.
Cancellation is checked between cycles, so a cancelled reply keeps every token already committed.
The UI thread never touches the Session: even the provenance split of each Step's text happens here.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from textual.message import Message

from dflash_gguf.session import Session
from dflash_gguf.tui.calibration import measure_plain_speed
from dflash_gguf.tui.messages import (
    CalibrationFailed,
    CalibrationFinished,
    ReplyFailed,
    ReplyFinished,
    StepArrived,
)
from dflash_gguf.tui.provenance import ProvenanceSplitter


def one_line(error: BaseException) -> str:
    """An exception as the single line the UI shows."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class SessionWorker:
    """Runs Session calls for the app, one at a time; `post` is the app's thread-safe post_message."""

    def __init__(self, session: Session, post: Callable[[Message], object]) -> None:
        self._session = session
        self._post = post
        self._lock = threading.Lock()
        # set when the app exits, so a running call stops at its next cycle
        self.closing = threading.Event()

    def reply(
        self,
        turn: int,
        messages: Sequence[dict[str, str]],
        gen_kwargs: dict[str, Any],
        cancel: threading.Event,
    ) -> None:
        """Stream one assistant reply to `messages`, posting every cycle as it is committed."""
        finish_reason: str | None = None
        cancelled = False
        with self._lock:
            if cancel.is_set() or self.closing.is_set():
                self._post(ReplyFinished(turn, None, True))
                return
            splitter = ProvenanceSplitter(self._session.target.token_bytes)
            try:
                # the GGUF chat template, its stop strings, and the cached prefix of the last turn reused
                steps = self._session.stream_chat(list(messages), **gen_kwargs)
                try:
                    for step in steps:
                        self._post(StepArrived(turn, step, splitter.split(step), time.perf_counter()))
                        finish_reason = step.finish_reason
                        if finish_reason is None and (cancel.is_set() or self.closing.is_set()):
                            cancelled = True
                            break
                finally:
                    steps.close()
            except Exception as error:  # any failure of the run is shown in the UI, which keeps running
                self._post(ReplyFailed(turn, one_line(error)))
                return
            stats = None if cancelled else self._session.last_stats
        if stats is None:
            self._post(ReplyFinished(turn, finish_reason, cancelled))
        else:
            self._post(ReplyFinished(turn, finish_reason, cancelled, stats.n_prompt_tokens, stats.n_cached_tokens))

    def calibrate(self, gen_kwargs: dict[str, Any]) -> None:
        """Measure plain decoding on this machine and post the result."""
        with self._lock:
            try:
                speed = measure_plain_speed(self._session.stream, gen_kwargs, should_stop=self.closing.is_set)
            except Exception as error:  # a failed measurement leaves the speedup unknown, not the app dead
                self._post(CalibrationFailed(one_line(error)))
                return
        self._post(CalibrationFinished(speed))

"""The worker-thread side of the chat: Session calls run here; the UI thread never touches the Session.

One Session call at a time (a lock). Cancellation is checked between cycles, so a cancelled reply keeps
every token already committed. Steps are not posted one message each: the worker appends them, with
the time it received them, to the reply's inbox (a list append, atomic under the GIL), and the app
drains the inbox on its own timer. A message per cycle made the UI thread dispatch one event per token
and wake up for each, time the decode loop then waited for the interpreter.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

from textual.message import Message

from dflash_gguf.session import Session
from dflash_gguf.steps import Step
from dflash_gguf.tui.messages import ReplyFailed, ReplyFinished


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
        inbox: list[tuple[Step, float]],
    ) -> None:
        """Stream one assistant reply to `messages`, appending every Step to `inbox` as it is committed."""
        finish_reason: str | None = None
        cancelled = False
        with self._lock:
            if cancel.is_set() or self.closing.is_set():
                self._post(ReplyFinished(turn, None, True))
                return
            try:
                # the GGUF chat template, its stop strings, and the cached prefix of the last turn reused
                steps = self._session.stream_chat(list(messages), **gen_kwargs)
                try:
                    for step in steps:
                        inbox.append((step, time.perf_counter()))
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

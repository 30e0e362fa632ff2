"""SIGTERM handled like Ctrl-C, so that `kill` stops a stage at a point where it can save."""

from __future__ import annotations

import signal
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM (e.g. `kill`) checkpoints like Ctrl-C instead of dying mid-step."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)

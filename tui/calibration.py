"""Plain-decoding speed of the target on this machine: what the speedup figure divides by.

Measured, never assumed: a short plain (speculative=False) run of the same Session, timed exactly as a
reply is (ReplyStats), so the ratio compares like with like.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from dflash_gguf.tui.provenance import StepLike
from dflash_gguf.tui.stats import ReplyStats

# a prompt a small instruct model continues at length, so the run is not cut short by an end token
CALIBRATION_PROMPT = "Count from 1 to 200, separated by commas: 1, 2, 3,"
CALIBRATION_TOKENS = 48
# fewer timed tokens than this and the figure is noise
MIN_TIMED_TOKENS = 8


class CalibrationError(RuntimeError):
    """The plain run was too short to time."""


def measure_plain_speed(
    stream: Callable[..., Iterator[StepLike]],
    gen_kwargs: dict[str, Any],
    *,
    n_tokens: int = CALIBRATION_TOKENS,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """Tokens per second of plain decoding via `stream` (a Session's `stream`), with the chat's sampling.

    `should_stop` is checked between cycles so the app can quit without waiting for the run.
    """
    kwargs = dict(gen_kwargs, max_tokens=n_tokens, speculative=False, block_size=None)
    stats = ReplyStats()
    steps = stream(CALIBRATION_PROMPT, **kwargs)
    try:
        for step in steps:
            stats.observe(step, time.perf_counter())
            if should_stop():
                break
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()
    speed = stats.tokens_per_s
    if speed is None or stats.timed_tokens < MIN_TIMED_TOKENS:
        raise CalibrationError(f"the plain-decoding run produced only {stats.tokens} tokens; cannot time it")
    return speed

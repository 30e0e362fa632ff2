"""Plain-decoding speed of the target on this machine: what the speedup figure divides by.

Measured, never assumed: short plain (speculative=False) runs of the same Session, timed exactly as a
reply is (ReplyStats), so the ratio compares like with like. The median of a few runs, so one run slowed
by another process on the machine does not set the baseline.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Generator

from dflash_gguf.tui.provenance import StepLike
from dflash_gguf.tui.stats import ReplyStats

# a prompt a small instruct model continues at length, so the run is not cut short by an end token
CALIBRATION_PROMPT = "Count from 1 to 200, separated by commas: 1, 2, 3,"
CALIBRATION_TOKENS = 24
CALIBRATION_RUNS = 3
# fewer timed tokens than this and the figure is noise
MIN_TIMED_TOKENS = 8


class CalibrationError(RuntimeError):
    """The plain run was too short to time."""


def measure_plain_speed(
    stream: Callable[..., Generator[StepLike, None, None]],
    gen_kwargs: dict[str, Any],
    *,
    n_tokens: int = CALIBRATION_TOKENS,
    runs: int = CALIBRATION_RUNS,
    should_stop: Callable[[], bool] = lambda: False,
) -> float:
    """Tokens per second of plain decoding via `stream` (a Session's `stream`), with the chat's sampling:
    the median of `runs` runs.

    `should_stop` is checked between cycles so the app can quit without waiting for the runs.
    """
    kwargs = dict(gen_kwargs, max_tokens=n_tokens, speculative=False, block_size=None)
    speeds = []
    for _ in range(runs):
        speeds.append(_timed_run(stream, kwargs, should_stop))
        if should_stop():
            break
    return statistics.median(speeds)


def _timed_run(
    stream: Callable[..., Generator[StepLike, None, None]], kwargs: dict[str, Any], should_stop: Callable[[], bool]
) -> float:
    stats = ReplyStats()
    steps = stream(CALIBRATION_PROMPT, **kwargs)
    try:
        for step in steps:
            stats.observe(step, time.perf_counter())
            if should_stop():
                break
    finally:
        steps.close()  # frees the Session at once, not when the generator is collected
    speed = stats.tokens_per_s
    if speed is None or stats.timed_tokens < MIN_TIMED_TOKENS:
        raise CalibrationError(f"the plain-decoding run produced only {stats.tokens} tokens; cannot time it")
    return speed

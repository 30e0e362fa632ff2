"""Generations advanced in lockstep: one Step of each in turn, each timed over its own turns only.

A shared or throttled machine changes speed by 10-20% between identical one-second runs, and one pair of
runs one after the other spread 0.75-1.50x on this project's CPU. Taking turns every cycle (milliseconds)
slows every run alike, so the ratio of their rates keeps only what the runs really cost. Used by
`dflash-bench` and `dflash-generate --compare`; each run must be on its own Session (a fork shares the
weights), since one Session runs one generation at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping

from .steps import Step, StepKind

__all__ = ["Run", "lockstep", "order"]


@dataclass
class Run:
    """One generation's Steps and the time spent inside its own turns (consumer time excluded)."""

    steps: list[Step] = field(default_factory=list)
    spent_s: float = 0.0  # in this run's next() calls, prefill included
    ttft_s: float = 0.0  # in its turns up to the first token

    @property
    def tokens(self) -> list[int]:
        return [t for step in self.steps for t in step.tokens]


def lockstep(streams: Mapping[str, Iterator[Step]], on_step: Callable[[str, Step], None] | None = None) -> dict[str, Run]:
    """Advance every stream one Step at a time, in the mapping's order, until all have ended."""
    runs = {name: Run() for name in streams}
    live = list(streams)
    while live:
        for name in list(live):
            start = time.perf_counter()
            step = next(streams[name], None)
            runs[name].spent_s += time.perf_counter() - start
            if step is None:
                live.remove(name)
                continue
            runs[name].steps.append(step)
            if step.kind is StepKind.PREFILL:
                runs[name].ttft_s = runs[name].spent_s
            if on_step is not None:
                on_step(name, step)
    return runs


def order(names: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The turn order of a repeat: forwards, then backwards, so that no run always goes first."""
    return names if repeat % 2 == 0 else names[::-1]

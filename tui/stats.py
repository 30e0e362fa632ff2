"""Running statistics of one reply, folded in Step by Step: a view of dflash_gguf.stats, never a second model.

Every decoding figure (τ, drafted, accepted, the per-slot acceptance, the loop's own speed, the rate of
the reply's own plain cycles) comes from the one StatsBuilder the Session uses. What this adds is only
what a live view needs on top: the sparkline's recent cycles, the latest block and reason, and the
wall-clock rate at which the worker received the Steps (the overhead benchmark's figure).
"""

from __future__ import annotations

from collections import deque

from dflash_gguf.stats import StatsBuilder
from dflash_gguf.steps import Step, StepKind

# the sparkline shows this many most recent cycles, one bar each
SPARKLINE_CYCLES = 48


class ReplyStats:
    """Counters of one reply; `observe` takes each Step with the perf_counter time the worker received it."""

    def __init__(self) -> None:
        self.builder = StatsBuilder()
        self.recent_accepted: deque[int] = deque(maxlen=SPARKLINE_CYCLES)
        self.block_size: int | None = None
        self.reason = ""
        self.prefill_s: float | None = None
        self._first_at: float | None = None
        self._last_at: float | None = None
        self._tokens_after_first = 0

    def observe(self, step: Step, at: float) -> None:
        self.builder.add(step)
        self._last_at = at
        if step.kind is StepKind.PREFILL:
            self._first_at = at
            self.prefill_s = step.verify_s
            return
        self._tokens_after_first += len(step.tokens)
        if step.kind is StepKind.CONTEXT_FULL:
            return
        self.recent_accepted.append(step.n_accepted)
        self.block_size = step.block_size
        self.reason = step.reason

    # ---- what the panel reads ----------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return self.builder.n_tokens

    @property
    def cycles(self) -> int:
        return self.builder.cycles

    @property
    def drafted(self) -> int:
        return self.builder.n_drafted

    @property
    def accepted(self) -> int:
        return self.builder.n_accepted

    @property
    def tau(self) -> float | None:
        return self.builder.tau

    @property
    def plain_cycles(self) -> int:
        return self.builder.plain_cycles

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed measured inside the loop (each cycle's cycle_s): what the speedup compares."""
        return self.builder.loop_tokens_per_s

    @property
    def in_reply_plain_tokens_per_s(self) -> float | None:
        """The rate of this reply's own plain cycles, once there are enough of them to be a baseline."""
        return self.builder.in_reply_plain_tokens_per_s

    @property
    def wall_tokens_per_s(self) -> float | None:
        """Tokens per second as the worker received them after the prefill (consumer time included)."""
        if self._first_at is None or self._last_at is None or self._last_at <= self._first_at:
            return None
        return self._tokens_after_first / (self._last_at - self._first_at)

    def slot_rates(self) -> list[float]:
        """How often each block slot's draft token was accepted, among cycles that drafted it."""
        b = self.builder
        return [a / d for a, d in zip(b.slot_accepted, b.slot_drafted) if d]

    def version(self) -> tuple[int, int]:
        """Changes whenever a figure does: the panel redraws only then."""
        return self.builder.n_tokens, self.builder.cycles

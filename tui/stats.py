"""Running statistics of one reply, folded in Step by Step: a view of dflash_gguf.stats, never a second model.

Every decoding figure (τ, drafted, accepted, per source, per slot, the loop's own speed, the rate of the
reply's own plain cycles, the confidence head's calibration) comes from the one StatsBuilder the Session
uses. What this adds is only what a live view needs on top: the sparkline's recent cycles and the
latest block and reason.
"""

from __future__ import annotations

from collections import deque

from dflash_gguf.prompt_cache import CacheEvent
from dflash_gguf.stats import Calibration, SourceStats, StatsBuilder, TreeStats
from dflash_gguf.steps import Step, StepKind

# the sparkline shows this many most recent cycles, one bar each
SPARKLINE_CYCLES = 48


class ReplyStats:
    """Counters of one reply, fed every Step in order."""

    def __init__(self) -> None:
        self.builder = StatsBuilder()
        self.recent_accepted: deque[int] = deque(maxlen=SPARKLINE_CYCLES)
        self.block_size: int | None = None
        self.tree_nodes = 0  # rows of the latest cycle's draft tree; 0: a linear block or none
        self.reason = ""
        self.prefill_s: float | None = None
        # what the prompt cache did, from the Session's stats once the reply ended (None: not yet, or no cache)
        self.prompt_cache: CacheEvent | None = None

    def observe(self, step: Step) -> None:
        self.builder.add(step)
        if step.kind is StepKind.PREFILL:
            self.prefill_s = step.verify_s
            return
        if step.kind is StepKind.CONTEXT_FULL:
            return
        self.recent_accepted.append(step.n_accepted)
        self.block_size = step.block_size
        self.tree_nodes = step.tree_nodes
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
    def tree(self) -> TreeStats | None:
        """The reply's cycles that verified draft trees; None while none has."""
        t = self.builder.tree
        return TreeStats(*t) if t[0] else None

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

    def per_source(self) -> dict[str, SourceStats]:
        return self.builder.per_source

    @property
    def calibration(self) -> Calibration | None:
        return self.builder.calibration

    def slot_rates(self) -> list[float]:
        """How often each block slot's draft token was accepted, among cycles that drafted it."""
        return self.builder.acceptance_by_slot

    def version(self) -> tuple[int, int]:
        """Changes whenever a figure does: the panel redraws only then."""
        return self.builder.n_tokens, self.builder.cycles

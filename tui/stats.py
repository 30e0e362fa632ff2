"""Running statistics of one reply, folded in cycle by cycle from the Session's Step events.

The panel redraws from this while tokens stream, so every figure here is cheap to read at any moment.
Speeds are wall-clock, measured in the worker thread as each Step arrives, and exclude the first Step
(the prompt's prefill), so a speculative and a plain run are measured the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_gguf.tui.provenance import StepLike


@dataclass
class ReplyStats:
    """Counters of one reply; `observe` takes each Step with the perf_counter time it arrived.

    The first Step of a reply is the token sampled from the prefill: it counts as a token but not as a
    decoding cycle, and timing starts when it arrives. Its verify_s is the prefill time, short on a
    follow-up turn because the Session reuses the cached prefix.
    """

    cycles: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    # slot k (0-based draft position): cycles that drafted at least k+1 tokens / that had slot k accepted
    slot_offered: list[int] = field(default_factory=list)
    slot_accepted: list[int] = field(default_factory=list)
    accepted_per_cycle: list[int] = field(default_factory=list)
    block_size: int | None = None
    reason: str = ""
    prefill_s: float | None = None
    _first_at: float | None = None
    _last_at: float | None = None
    _tokens_after_first: int = 0

    def observe(self, step: StepLike, at: float) -> None:
        """Fold one Step in."""
        n_tokens = len(step.tokens)
        self.tokens += n_tokens
        self._last_at = at
        if self._first_at is None:
            self._first_at = at
            self.prefill_s = step.verify_s
            return
        self._tokens_after_first += n_tokens
        if step.block_size == 0:  # a closing Step that decoded nothing (the context is full)
            return
        self.cycles += 1
        self.drafted += step.n_drafted
        self.accepted += step.n_accepted
        self.accepted_per_cycle.append(step.n_accepted)
        self.block_size = step.block_size
        self.reason = step.reason
        while len(self.slot_offered) < step.n_drafted:
            self.slot_offered.append(0)
            self.slot_accepted.append(0)
        for k in range(step.n_drafted):
            self.slot_offered[k] += 1
            if k < step.n_accepted:
                self.slot_accepted[k] += 1

    @property
    def timed_tokens(self) -> int:
        """Tokens the speed is computed over (all but the prefill Step's)."""
        return self._tokens_after_first

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed after the prefill; None until a decoding cycle has arrived."""
        if self._first_at is None or self._last_at is None or self._last_at <= self._first_at:
            return None
        return self._tokens_after_first / (self._last_at - self._first_at)

    @property
    def tau(self) -> float | None:
        """The acceptance length: accepted drafts plus the target's own token, averaged over cycles.

        Counted from the verification, not from Step.tokens, which leave out an end-of-generation token.
        """
        return self.accepted / self.cycles + 1.0 if self.cycles else None

    def slot_rates(self) -> list[float]:
        """How often each block slot's draft token was accepted, among cycles that drafted it."""
        return [a / o for a, o in zip(self.slot_accepted, self.slot_offered)]


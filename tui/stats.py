"""Running statistics of one reply, folded in cycle by cycle from the Session's Step events.

The panel redraws from this while tokens stream, so every figure here is cheap to read at any moment.
Speeds are wall-clock, measured in the worker thread as each Step arrives, and exclude the first cycle
(it carries the prompt's prefill), so a speculative and a plain run are measured the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, Sequence


class Provenance(Enum):
    """Where a committed token came from."""

    DRAFT = "draft"  # proposed by the drafter and accepted by the target
    BONUS = "bonus"  # the target's own next token at the end of a verified block
    PLAIN = "plain"  # decoded by the target alone (no draft that cycle)


class StepLike(Protocol):
    """The fields of a Session Step the UI reads."""

    tokens: Sequence[int]
    n_drafted: int
    n_accepted: int
    block_size: int
    reason: str


def token_provenance(step: StepLike) -> list[Provenance]:
    """One Provenance per committed token of a cycle: the accepted drafts, then the target's bonus.

    A cycle without drafts is plain decoding. A cycle cut short (a stop string, max_tokens) may commit
    fewer tokens than n_accepted + 1, so the list follows step.tokens.
    """
    if step.n_drafted == 0:
        return [Provenance.PLAIN] * len(step.tokens)
    return [Provenance.DRAFT if i < step.n_accepted else Provenance.BONUS for i in range(len(step.tokens))]


@dataclass
class ReplyStats:
    """Counters of one reply; `observe` takes each Step with the perf_counter time it arrived."""

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
    _first_at: float | None = None
    _last_at: float | None = None
    _tokens_after_first: int = 0

    def observe(self, step: StepLike, at: float) -> None:
        """Fold one cycle in."""
        n_tokens = len(step.tokens)
        if self._first_at is None:
            self._first_at = at
        else:
            self._tokens_after_first += n_tokens
        self._last_at = at
        self.cycles += 1
        self.tokens += n_tokens
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
        """Tokens the speed is computed over (all but the first cycle's)."""
        return self._tokens_after_first

    @property
    def tokens_per_s(self) -> float | None:
        """Decode speed after the first cycle; None until two cycles have arrived."""
        if self._first_at is None or self._last_at is None or self._last_at <= self._first_at:
            return None
        return self._tokens_after_first / (self._last_at - self._first_at)

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per cycle (the acceptance length)."""
        return self.tokens / self.cycles if self.cycles else None

    def slot_rates(self) -> list[float]:
        """How often each block slot's draft token was accepted, among cycles that drafted it."""
        return [a / o for a, o in zip(self.slot_accepted, self.slot_offered)]


def step_pieces(step: StepLike) -> list[tuple[str, Provenance]]:
    """The cycle's text split per committed token, each with its provenance."""
    return list(zip(step.pieces, token_provenance(step)))

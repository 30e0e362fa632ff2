"""Draft sources behind one protocol: each offers a continuation for the next cycle and observes commits.

The loop asks every source for its offer (how far it can draft now, and what it expects each length to
commit, from what it has learnt of its own acceptance), lets the policy pick one (source, length), has
that source propose, verifies, and tells every source what was committed. Adding a source touches no line
of the loop, the policy or the Session: pass it in `Session(sources=[...])`, or give every Session one by
its factory's line in `speculation.SOURCES`. This module is the protocol alone: the native drafter's source
(drafter_source.py) and the policy (controller.py) import it, never the other way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

from .sampling import SamplingParams
from .steps import provenance_of

if TYPE_CHECKING:
    from .target import FeatureRows
    from .tree import DraftTree


@dataclass(frozen=True)
class Candidate:
    """Drafted tokens for block slots 1..n and how they were drawn.

    q: None for greedy or point-mass drafts; dense (n, V), or sparse (n, k) over q_ids (n, k).
    point_mass: the tokens were chosen deterministically (lookup): with sampling, each is accepted
    with the target's own probability of it. confidences: predicted P(accepted) per slot, if known.
    tree: the drafts as a tree (tree.DraftTree, the anchor its row 0) to verify in one batch; `tokens`
    are then the linear block the loop verifies where a tree cannot be (its first path; lookup's whole draft).
    """

    source: str
    tokens: np.ndarray
    q: np.ndarray | None = None
    q_ids: np.ndarray | None = None
    confidences: np.ndarray | None = None
    point_mass: bool = False
    tree: "DraftTree | None" = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def proposal(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(q, q_ids) that rejection sampling needs: a point mass is q = 1 on each drafted token."""
        if self.point_mass:
            return np.ones((len(self), 1)), self.tokens.reshape(-1, 1)
        if self.q is None:
            raise ValueError(f"draft source {self.source!r} sampled without saying from which distribution (q)")
        return self.q, self.q_ids

    def head(self, n: int) -> "Candidate":
        """The first n slots (a confidence cut)."""
        cut = lambda a: None if a is None else a[:n]  # noqa: E731
        return Candidate(self.source, self.tokens[:n], cut(self.q), cut(self.q_ids), cut(self.confidences), self.point_mass)


@dataclass(frozen=True)
class Commit:
    """Tokens the target now holds at positions start.., and (lazily) their layer-input features."""

    start: int
    tokens: Sequence[int]
    # appends the tokens' layer-input features to the rows given; valid only while observe() runs
    features: Callable[[FeatureRows], None] | None = None
    # every token the target holds, these last: the loop's one copy (decoding.CacheState), shared with a
    # source that reads history (lookup) instead of copied into it; read it, never change it
    sequence: Sequence[int] | None = None


@dataclass(frozen=True)
class Offer:
    """What a source offers for the next cycle: up to n_max drafts, and the numbers the policy prices them by.

    expected[n]: tokens a cycle verifying n of its drafts is expected to commit, n = 0.. (the bonus
    token included, so expected[0] == 1), from the source's own acceptance profile; the policy prices each
    length with the measured verify costs. None: no estimate (the source drafts only in fixed blocks).
    draft_s[n]: seconds its draft of n tokens takes, n = 0.., as the source timed its own drafts
    (controller.DraftTimes); None where it does not time them, and the policy prices its drafts with what
    the loop's timings of them taught it.
    probing: it explores (a source that has set drafting aside and only probes now and then, or a length it
    has too little evidence on): it bids nothing, and drafts only where no other offer pays, as a probe.
    schedule: a source that keeps its own schedule (the native drafter's controller: its acceptance
    profile, probing and back-off, its trees) is priced through it instead: its bid in tokens per second,
    and the cycle it would draft; that block may be longer than n_max and is cut to it.
    """

    source: str
    n_max: int
    expected: Sequence[float] | None = None
    draft_s: Sequence[float] | None = None
    probing: bool = False
    schedule: "Schedule | None" = None


class Shape(Protocol):
    """A cycle a Schedule chose (controller.BlockChoice): how many drafts (0: plain), whether it probes, why."""

    n_draft: int
    probe: bool
    reason: str


class Schedule(Protocol):
    """What the policy asks of a source that schedules its own cycles (controller.BlockController). The
    source owns it (and what it learns); the policy prices rivals with the same `costs` and reports back:
    the loop tells only the policy how many drafts a cycle verified (after a confidence or grammar cut) and
    what it cost, so the outcome reaches the schedule through it."""

    costs: "VerifyCostsLike"

    def drafting_rate(self) -> float | None:
        """Expected tokens/s of the cycle it would draft now; None while it keeps to plain decoding (not
        asked while its source's offer is probing)."""

    def choose(self) -> Shape:
        """This cycle's shape (advances its schedule: call once per cycle it is asked to decide)."""

    def observe(self, n_draft: int, n_accepted: int, verified_rows: int | None = None) -> bool:
        """The outcome of the cycle it chose; True where the rows verified were its tree."""


class VerifyCostsLike(Protocol):
    """The cost model a Schedule prices with and the policy folds a cycle's timings into (controller.CostModel)."""

    def observe(self, kind: str, n_tokens: int, seconds: float) -> None: ...


class DraftSource(ABC):
    """One way of proposing tokens; `name` keys the policy's statistics and the Steps' `source`, and is the
    provenance of the tokens it got accepted."""

    name: str
    max_draft: int
    needs_features: bool = False  # whether observe() reads Commit.features (the loop captures them only then)
    # the prompt cache's name for the state save_state() gives; None: its state is a function of the tokens
    state_part: str | None = None

    @abstractmethod
    def cached(self) -> int:
        """Positions (from 0) whose state this source holds: a reused prompt prefix can be no longer."""

    @abstractmethod
    def truncate(self, n: int) -> None:
        """Forget every position >= n (the target dropped them; the committed sequence still holds them)."""

    @abstractmethod
    def available(self, last: int, n_past: int) -> int:
        """How many tokens it could propose after `last` at n_past, cheaply (0 = nothing now)."""

    def offer(self, last: int, n_past: int, n_max: int) -> Offer:
        """Its offer after `last` at n_past, n_max >= 1 drafts at most (available() said so just before).

        A source that learns how its drafts pass says what each length is expected to commit; without
        an estimate it drafts only in fixed blocks."""
        return Offer(self.name, n_max)

    @property
    def provenance(self) -> str:
        """What the tokens it got accepted are recorded as (Step.provenance, the stats' tokens_by_provenance,
        the chat's colours): its name. A subclass may name another (a test's scripted source passes for lookup)."""
        return provenance_of(self.name)

    def drafts_in_block(self, block_size: int) -> int:
        """Drafts a fixed block of block_size holds: all but the last committed token's slot."""
        return block_size - 1

    @abstractmethod
    def propose(
        self, last: int, n_past: int, n_draft: int, params: SamplingParams, rng: np.random.Generator
    ) -> Candidate:
        """Draft n_draft tokens following `last`, which sits at position n_past."""

    @abstractmethod
    def observe(self, commit: Commit) -> None:
        """The target committed these tokens (a prefill chunk, or a cycle's last + accepted drafts)."""

    def finish(self) -> None:
        """The generation ended: bring state up to date so a follow-up turn can reuse it."""

    def close(self) -> None:
        """Free what it holds in C; a Session closes the sources it made itself (speculation.SOURCES) with it."""

    def save_state(self) -> bytes:
        """Its whole state after the cached() positions it holds (the prompt cache stores it under state_part)."""
        raise NotImplementedError(f"draft source {self.name!r} keeps no state but the tokens (state_part is None)")

    def restore_state(self, data: bytes | None, commit: Commit) -> None:
        """Put it in the state after commit.tokens (positions 0..), which the target now holds: `data` is what
        save_state() gave (None without a state_part, and then it observes the tokens, as a prefill would).
        RuntimeError or ValueError where the state does not restore; the caller then forgets every cache."""
        self.observe(commit)

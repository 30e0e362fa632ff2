"""Draft sources behind one protocol: each offers a continuation for the next cycle and observes commits.

The loop asks every source for its offer (how far it can draft now, and what it expects each length to
commit, from what it has learnt of its own acceptance), lets the policy pick one (source, length), has
that source propose, verifies, and tells every source what was committed. Adding a source touches no line
of the loop, the policy or the Session: pass it in `Session(sources=[...])`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .drafter import Drafter
from .sampling import SamplingParams
from .steps import TokenSource
from .target import FeatureRows

if TYPE_CHECKING:
    from .controller import BlockController
    from .tree import DraftTree, TreeShaper


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
    """What a source offers for the next cycle: up to n_max drafts, and what it expects of them.

    expected[n]: tokens a cycle verifying n of its drafts is expected to commit, n = 0.. (the bonus
    token included, so expected[0] == 1), from the source's own acceptance model; the policy prices each
    length with the measured costs. None: no estimate (the source drafts only in fixed blocks).
    controller: a source that keeps a BlockController (its acceptance profile, probing and back-off)
    offers through it instead; the controller's block may be longer than n_max and is cut to it.
    """

    source: str
    n_max: int
    expected: Sequence[float] | None = None
    controller: "BlockController | None" = None


class DraftSource(ABC):
    """One way of proposing tokens; `name` keys the policy's statistics and the Steps' `source`."""

    name: str
    provenance: TokenSource = TokenSource.DRAFT
    max_draft: int
    needs_features: bool = False  # whether observe() reads Commit.features (the loop captures them only then)

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


class NativeDrafterSource(DraftSource):
    """The libllama drafter (DFlash, DFlash2, DSpark) as a draft source.

    Committed rows' features are kept and injected in one batch before the next draft, so cycles that
    the controller keeps plain pay no drafter call at all. Its acceptance model is `controller` (set once
    its costs are measured), which the policy feeds with the outcome of every block it drafts.
    """

    needs_features = True

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = drafter.kind
        self.max_draft = drafter.max_draft
        self._controller: BlockController | None = None
        self._tree: TreeShaper | None = None
        self._offer = Offer(self.name, 0)  # the last offer, reused while n_max and the controller hold
        self._n = 0  # positions injected into the drafter's KV cache
        self._pending = FeatureRows(drafter.n_features)  # rows committed since (a plain streak holds hundreds)

    @property
    def controller(self) -> "BlockController | None":
        """Its acceptance model and cycle chooser, set once its costs are measured."""
        return self._controller

    @controller.setter
    def controller(self, controller: "BlockController | None") -> None:
        self._controller = controller
        self._attach()

    @property
    def tree(self) -> "TreeShaper | None":
        """Set (tree_nodes; any drafter kind): its cycles may verify trees; the controller prices them beside
        blocks and chooses each cycle's shape (a fixed block verifies a tree of the whole budget)."""
        return self._tree

    @tree.setter
    def tree(self, shaper: "TreeShaper | None") -> None:
        self._tree = shaper
        self._attach()

    def _attach(self) -> None:
        if self._controller is not None and self._tree is not None and self._controller.trees is not self._tree:
            self._controller.attach_trees(self._tree)

    def cached(self) -> int:
        return self._n

    def restored(self, n: int) -> None:
        """The drafter's KV cache was replaced by a saved state of n positions (the prompt cache)."""
        self._pending.clear()
        self._n = n

    def truncate(self, n: int) -> None:
        self._pending.clear()
        if n < self._n:
            self.drafter.remove(n)
            self._n = n

    def available(self, last: int, n_past: int) -> int:
        return self.max_draft

    def offer(self, last: int, n_past: int, n_max: int) -> Offer:
        if self._offer.n_max != n_max or self._offer.controller is not self.controller:
            self._offer = Offer(self.name, n_max, controller=self.controller)
        return self._offer

    def drafts_in_block(self, block_size: int) -> int:
        """Drafts a block of block_size holds: all of it for anchor-first DSpark, else all but the last token's slot."""
        return block_size if self.drafter.sample_from_anchor else block_size - 1

    def propose(
        self, last: int, n_past: int, n_draft: int, params: SamplingParams, rng: np.random.Generator
    ) -> Candidate:
        self.finish()
        c = self._controller
        rows = None if c is None else c.tree_rows_now()
        if self._tree is not None and rows != 0:  # chosen, not drawn: any sampling verifies them exactly (walk_sampled)
            costs = c.costs if c is not None and c.sized_now() else None
            tree = self._tree.shape(last, n_past, self.drafter.draft(last, n_past, n_draft), rows, costs)
            return Candidate(self.name, np.asarray(tree.tokens[1 : tree.first_leaf + 1]), point_mass=True, tree=tree)
        p = self.drafter.propose(last, n_past, n_draft, params, rng)
        return Candidate(self.name, p.tokens, p.q, p.q_ids, p.confidences)

    def observe(self, commit: Commit) -> None:
        if self.tree is not None:  # what the target took of the last tree: its shaper learns from it
            self.tree.observe(commit.start, commit.tokens)
        if commit.start != self._n + len(self._pending):
            raise RuntimeError(f"drafter features out of order: commit at {commit.start}, drafter at {self._n}")
        commit.features(self._pending)

    def finish(self) -> None:
        n = len(self._pending)
        if n:
            self.drafter.inject(self._pending.view(), self._n)
            self._pending.clear()
            self._n += n

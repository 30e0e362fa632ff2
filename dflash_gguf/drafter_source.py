"""The libllama drafter (DFlash, DFlash2, DSpark) as a draft source, with the controller that schedules its
cycles (its acceptance profile, probing and back-off, its trees): a source like any other, which owns what
it learns and saves and restores its state through the DraftSource protocol.
"""

from __future__ import annotations

import numpy as np

from .controller import BlockController
from .drafter import Drafter
from .sampling import SamplingParams
from .sources import Candidate, Commit, DraftSource, Offer
from .target import FeatureRows
from .tree import TreeShaper

__all__ = ["NativeDrafterSource"]


class NativeDrafterSource(DraftSource):
    """The libllama drafter (DFlash, DFlash2, DSpark) as a draft source.

    Committed rows' features are kept and injected in one batch before the next draft, so cycles that
    the controller keeps plain pay no drafter call at all. Its acceptance model is `controller` (set once
    its costs are measured), which the policy feeds with the outcome of every block it drafts.
    """

    needs_features = True
    state_part = "drafter"  # its KV cache: the injected target features' K/V

    def __init__(self, drafter: Drafter, *, tree_nodes: int = 0) -> None:
        """tree_nodes >= 2: its cycles may verify trees of up to that many rows (any drafter kind), which its
        own shaper grows from the drafter's candidates (TreeShaper refuses fewer); 0: blocks only."""
        self.drafter = drafter
        self.name = drafter.kind
        self.max_draft = drafter.max_draft
        self._controller: BlockController | None = None
        self._tree = TreeShaper(drafter.max_draft, tree_nodes, drafter=drafter) if tree_nodes else None
        self._offer = Offer(self.name, 0)  # the last offer, reused while n_max, the controller and probing hold
        self._n = 0  # positions injected into the drafter's KV cache
        self._pending = FeatureRows(drafter.n_features)  # rows committed since (a plain streak holds hundreds)

    @property
    def controller(self) -> "BlockController | None":
        """Its acceptance model and cycle chooser, set once its costs are measured."""
        return self._controller

    @controller.setter
    def controller(self, controller: "BlockController | None") -> None:
        if controller is not None and self._tree is not None and controller.trees is not self._tree:
            controller.attach_trees(self._tree)  # the controller prices its source's trees beside its blocks
        self._controller = controller

    @property
    def tree(self) -> TreeShaper | None:
        """Its tree shaper (tree_nodes; any drafter kind): its cycles may verify trees; the controller prices them
        beside blocks and chooses each cycle's shape (a fixed block verifies a tree of the whole budget)."""
        return self._tree

    def cached(self) -> int:
        return self._n

    def save_state(self) -> bytes:
        return self.drafter.save_state()

    def restore_state(self, data: bytes | None, commit: Commit) -> None:
        n = commit.start + len(commit.tokens)
        self._pending.clear()
        self._n = 0
        self.drafter.load_state(data)
        if self.drafter.pos_max() + 1 != n:
            raise RuntimeError(f"the drafter holds {self.drafter.pos_max() + 1} positions after restoring {n}")
        self._n = n

    def truncate(self, n: int) -> None:
        self._pending.clear()
        if n < self._n:
            self.drafter.remove(n)
            self._n = n

    def available(self, last: int, n_past: int) -> int:
        return self.max_draft

    def offer(self, last: int, n_past: int, n_max: int) -> Offer:
        """Priced through its controller; probing while the controller has set drafting aside."""
        c = self._controller
        probing = c is not None and c.set_aside
        o = self._offer
        if o.n_max != n_max or o.schedule is not c or o.probing is not probing:
            self._offer = o = Offer(self.name, n_max, probing=probing, schedule=c)
        return o

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

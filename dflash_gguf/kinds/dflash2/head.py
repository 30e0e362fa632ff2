"""DFlash2's head: a walk of the selector lattice libllama outputs through the nextn rows.

Each prediction slot's nextn row holds its top-k candidate ids, then for each candidate of the previous
slot the k pair scores of this slot's candidates (`logit[c] + <P[p] * W h, S[c]>`, dflash.cpp).
"""

from __future__ import annotations

import numpy as np

from ...sampling import SamplingParams, sample_token
from ...schema import Keys
from ..head import Head, HeadSource, Proposal


class LatticeHead(Head):
    """Pick one candidate per slot given the previous pick, as upstream decodes the lattice."""

    logits = False  # the lattice is all it reads: the block's slots output no logits
    nextn = True

    def __init__(self, source: HeadSource) -> None:
        self.top_k = int(source.meta(Keys.SELECTOR_TOP_K))

    def rows(self, logits: np.ndarray | None, nextn: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        return nextn, None

    def tree_candidates(self, rows: np.ndarray, anchor: int, k: int) -> "PairCandidates":
        """A node's children ranked by the selector's scores given the node's own pick (k: the lattice's own)."""
        return PairCandidates(rows, self.top_k)

    def propose(self, rows: np.ndarray, confidences: np.ndarray | None, last_token: int, params: SamplingParams,
                rng: np.random.Generator) -> Proposal:
        k = self.top_k
        n = rows.shape[0]
        ids = rows[:, :k].astype(np.int64)
        tokens = np.empty(n, dtype=np.int64)
        q = None if params.greedy else np.empty((n, k), dtype=np.float64)
        prev = 0
        for i in range(n):
            scores = rows[i, k + prev * k : k + (prev + 1) * k].astype(np.float64)
            if q is None:
                prev = int(scores.argmax())
            else:
                z = scores / params.temperature
                p = np.exp(z - z.max())
                q[i] = p / p.sum()
                prev = sample_token(q[i], rng)
            tokens[i] = ids[i, prev]
        return Proposal(tokens=tokens, q=q, q_ids=None if q is None else ids)


class PairCandidates:
    """DFlash 2: the path selector's lattice. Row i holds slot i + 1's k candidate ids, then k x k pair scores,
    score[i][j, r] being candidate r's where the previous slot's pick was its candidate j (the anchor counts as
    candidate 0, where the selector's decode starts: LatticeHead.propose). A node's children are its slot's
    candidates ranked by the softmax of the scores given the node's own candidate index."""

    def __init__(self, lattice: np.ndarray, k: int) -> None:
        lattice = np.asarray(lattice)
        if k < 1 or lattice.ndim != 2 or lattice.shape[1] < k + k * k:
            raise ValueError(f"a selector lattice of top-k {k} needs rows of >= {k + k * k} values, got {lattice.shape}")
        self.n_slots = lattice.shape[0]
        self.ids = lattice[:, :k].astype(np.int64)  # copies: the drafter's output is a view valid until its next call
        self.scores = lattice[:, k : k + k * k].astype(np.float64).reshape(self.n_slots, k, k)

    def after(self, depth: int, token: int) -> tuple[np.ndarray, np.ndarray]:
        prev = 0 if depth == 0 else int(np.flatnonzero(self.ids[depth - 1] == token)[0])
        z = self.scores[depth, prev]
        p = np.exp(z - z.max())
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        return self.ids[depth][order], p[order]

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
    trees = False  # a slot's candidates depend on the pick before it

    def __init__(self, source: HeadSource) -> None:
        self.top_k = int(source.meta(Keys.SELECTOR_TOP_K))

    def rows(self, logits: np.ndarray | None, nextn: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        return nextn, None

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

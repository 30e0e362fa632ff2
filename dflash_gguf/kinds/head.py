"""A drafter kind's head: what the host computes over the rows libllama's graph gave for a drafted block.

libllama computes the graph (src/models/dflash.cpp: the DFlash layers, DFlash2's selector lattice, DSpark's
Markov bias and confidences); the `Drafter` reads the rows its kind's head asks for, each prediction slot's
logits (n_vocab wide) and/or its nextn row (n_embd wide), and hands them here. A head turns them into the
rows `Drafter.draft` returns and, from those, into a `Proposal`. The base head (`LogitsHead`, DFlash's)
applies the z-lab output transforms libllama leaves to the reader and takes the argmax or samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from ..sampling import SamplingParams, probabilities, sample_token
from ..schema import Keys


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens for block slots 1..n and the distribution each was drawn from.

    q is None for greedy drafts; dense (n, V) for DFlash; for DFlash2 sparse: q (n, k)
    over the candidate ids q_ids (n, k), as acceptance.accept_sampled takes it.
    """

    tokens: np.ndarray
    q: np.ndarray | None = None
    q_ids: np.ndarray | None = None
    confidences: np.ndarray | None = None  # predicted P(accepted) per slot, where the drafter has a head for it


@dataclass(frozen=True)
class HeadSource:
    """What a head is built from: the drafter's file and its loaded model (libllama's metadata reader)."""

    path: Path
    n_embd: int
    n_vocab: int
    meta: Callable[[str], str | None]  # a metadata value of the loaded model, as text; None when absent

    def meta_float(self, key: str) -> float:
        value = self.meta(key)
        return float(value) if value else 0.0


class OutputTransforms:
    """DFlash1's graph leaves the z-lab output_multiplier and softcap to the reader (dflash.cpp)."""

    def __init__(self, source: HeadSource) -> None:
        self.scale = source.meta_float(Keys.LOGIT_SCALE)
        self.softcap = source.meta_float(Keys.FINAL_LOGIT_SOFTCAPPING)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        if self.scale:
            logits = logits * self.scale
        if self.softcap > 0:
            logits = np.tanh(logits / self.softcap) * self.softcap
        return logits


# -- a draft tree's candidates (tree.py grows trees from them) --------------------------------------------

class Candidates(Protocol):
    """A drafter's candidates after a node of a tree (one cycle's draft, read as the tree grows)."""

    n_slots: int  # the deepest slot it predicts

    def after(self, depth: int, token: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids (k,), q (k,)): the candidates for slot depth + 1 after a node at `depth` holding `token` (the
        anchor is depth 0), best first, and the drafter's probability of each; a function of (depth, token)."""
        ...


def top_row(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (k,), q (k,)): the k likeliest tokens of one row of logits (V,), best first, and their softmax
    probabilities over the whole row.

    A drafter with a reduced draft vocabulary (d2t) leaves every other column at -inf (the embedded drafter:
    40,960 of 49,152), and a partition over that many equal values costs ~2.5 ms a row; their probability is
    exactly 0, so the top k and the normaliser are taken over the finite columns alone (all columns where
    fewer than k are finite). The ranking is the row's own (float32 is ordered as its float64 values are);
    the normaliser is a float64 log-sum-exp, the same sum as over the whole row but for its zero terms.
    """
    row = np.asarray(row)
    live = np.flatnonzero(row > -np.inf)
    if live.size < min(k, row.shape[0]):  # fewer finite than asked: the -inf ones rank last, at q = 0
        live = np.arange(row.shape[0])
    values = row[live]
    k = min(k, values.shape[0])
    part = np.argpartition(values, -k)[-k:] if k < values.shape[0] else np.arange(values.shape[0])
    part = part[np.argsort(-values[part], kind="stable")]
    z = values.astype(np.float64) - float(values.max())
    log_norm = np.log(np.exp(z).sum())
    return live[part], np.exp(z[part] - log_norm)


def top(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, q): the k likeliest tokens of each row of logits (n, V), best first, and their softmax
    probabilities (`top_row` per row)."""
    logits = np.asarray(logits)
    k = min(k, logits.shape[1])
    ids = np.empty((logits.shape[0], k), dtype=np.int64)
    q = np.empty((logits.shape[0], k), dtype=np.float64)
    for i, row in enumerate(logits):
        ids[i], q[i] = top_row(row, k)
    return ids, q


def candidates(logits: np.ndarray, k: int) -> np.ndarray:
    """(D, k) the k likeliest tokens of each row of drafter logits, best first."""
    return top(logits, k)[0]


class SlotCandidates:
    """DFlash: a block predicts every slot at once, so a slot's candidates do not depend on the parent."""

    def __init__(self, ids: np.ndarray, q: np.ndarray) -> None:
        self.ids, self.q = np.asarray(ids), np.asarray(q, dtype=np.float64)
        if self.ids.ndim != 2 or self.q.shape != self.ids.shape:
            raise ValueError(f"ids and q must both be (slots, k), got {self.ids.shape} and {self.q.shape}")
        self.n_slots = self.ids.shape[0]

    @classmethod
    def from_logits(cls, logits: np.ndarray, k: int) -> "SlotLogits":
        """The k likeliest tokens of each slot's logits (D, V), slots 1..D, read as the tree asks for them."""
        return SlotLogits(logits, k)

    def after(self, depth: int, token: int) -> tuple[np.ndarray, np.ndarray]:
        return self.ids[depth], self.q[depth]


class SlotLogits:
    """DFlash's candidates read from the slots' logits (D, V) when a tree first asks for a slot: a tree of a few
    rows reads a few slots' top k of the drafted ones (each `top_row`), not all of them. `logits` may be the
    drafter's output view: the tree is grown before the drafter runs again (TreeShaper.shape)."""

    def __init__(self, logits: np.ndarray, k: int) -> None:
        self.logits, self.k = logits, k
        self.n_slots = logits.shape[0]
        self._slots: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def after(self, depth: int, token: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._slots.get(depth)
        if got is None:
            got = self._slots[depth] = top_row(self.logits[depth], self.k)
        return got


class Head(ABC):
    """What the host computes over one drafted block's output rows; one per drafter context.

    `logits` / `nextn` say which rows the drafter reads for each prediction slot (nextn: libllama's unmasked
    nextn rows, one per block token); `rows` gets them as views valid until the next drafter call.
    """

    logits: bool = True  # each block slot outputs its logits
    nextn: bool = False  # and the context outputs its nextn rows (llama_ext.set_embeddings_nextn)
    confidences: bool = False  # `rows` gives each slot's predicted P(accepted)

    @abstractmethod
    def rows(self, logits: np.ndarray | None, nextn: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        """(what Drafter.draft returns, the slots' confidences or None) from the prediction slots' rows."""

    def condition(self, row: np.ndarray, graph_prev: int, prev: int) -> np.ndarray:
        """A slot's row (as `rows()` gave it) as if the token before the slot were `prev`, where the graph
        computed it after `graph_prev` (the slot before's argmax; the anchor for the first): what a draft, or
        a tree's node, below a token other than the graph's draws from. A kind whose slots' rows do not depend
        on the token before (DFlash's logits; DFlash2's lattice, which holds every predecessor's scores) keeps
        the row."""
        return row

    def tree_candidates(self, rows: np.ndarray, anchor: int, k: int) -> Candidates:
        """The block's candidates as a draft tree grows them after `anchor` (k per node at most), from `rows`
        (what `rows()` gave): per-slot logits, a slot's candidates the same below any parent (DFlash's), each
        slot's read when the tree first reaches it."""
        return SlotCandidates.from_logits(rows, k)

    @abstractmethod
    def propose(self, rows: np.ndarray, confidences: np.ndarray | None, last_token: int, params: SamplingParams,
                rng: np.random.Generator) -> Proposal:
        """Draft tokens from `rows` (what `rows()` gave): argmax when greedy, else sampled with the q it reports."""


class LogitsHead(Head):
    """The base kind's head (DFlash): each slot's logits, transformed, drawn from independently."""

    def __init__(self, source: HeadSource) -> None:
        self.transforms = OutputTransforms(source)

    def rows(self, logits: np.ndarray | None, nextn: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        return self.transforms(logits), None

    def propose(self, rows: np.ndarray, confidences: np.ndarray | None, last_token: int, params: SamplingParams,
                rng: np.random.Generator) -> Proposal:
        if params.greedy:
            return Proposal(tokens=rows.argmax(axis=1))
        q = probabilities(rows, params)
        return Proposal(tokens=np.array([sample_token(row, rng) for row in q]), q=q)

"""DSpark's head: its Markov head and confidence head on the host, over the logits libllama's graph biased.

libllama's graph (src/models/dflash.cpp, build_dspark_markov_head) biases each block position's
logits by `W2 @ W1[prev]` and scores `sigmoid(c . [hidden; W1[prev]] + b)`, where `prev` is the
previous position's *argmax* (the anchor for the first). That is exact for greedy drafting. A
sampled draft conditions the next position on the token really drawn (DeepSpec's
`sample_block_tokens`), so `MarkovHead.correct` moves a row from the argmax's bias to the sampled
token's: the q a token is drawn from, and handed to rejection sampling, is that corrected row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np

from ...sampling import SamplingParams, probabilities, sample_token
from ...schema import Keys, Tensors
from ..head import Head, HeadSource, OutputTransforms, Proposal, top_row

_EPS = 1e-7


@dataclass
class MarkovHead:
    """DSpark's vanilla Markov head (and confidence head) as the GGUF holds them, in float32 on the host."""

    w1: np.ndarray  # (n_vocab, rank): W1[prev]
    w2: np.ndarray  # (n_vocab_draft, rank)
    d2t: np.ndarray | None  # (n_vocab_draft,) target ids of the draft rows, or None (full vocabulary)
    conf_markov: np.ndarray | None  # (rank,): the confidence projection's weights on W1[prev]

    @property
    def rank(self) -> int:
        return int(self.w1.shape[1])

    def bias(self, token: int, n_vocab: int) -> np.ndarray:
        """W2 @ W1[token] over the target vocabulary (0 on rows a reduced draft vocabulary lacks)."""
        b = self.w2 @ self.w1[int(token)]
        if self.d2t is None:
            return b
        full = np.zeros(n_vocab, dtype=np.float32)
        full[self.d2t] = b
        return full

    def correct(self, row: np.ndarray, graph_prev: int, prev: int) -> np.ndarray:
        """A row the graph biased with W1[graph_prev], re-biased with W1[prev] (a copy; the row itself if equal)."""
        if graph_prev == prev:
            return row
        delta = self.w2 @ (self.w1[int(prev)] - self.w1[int(graph_prev)])
        out = np.array(row, dtype=np.float32, copy=True)
        if self.d2t is None:
            out += delta
        else:
            out[self.d2t] += delta
        return out

    def correct_confidence(self, confidence: float, graph_prev: int, prev: int) -> float:
        """The graph's confidence (scored with W1[graph_prev]) rescored with W1[prev]."""
        if graph_prev == prev or self.conf_markov is None:
            return float(confidence)
        c = min(max(float(confidence), _EPS), 1.0 - _EPS)
        logit = math.log(c / (1.0 - c)) + float(self.conf_markov @ (self.w1[int(prev)] - self.w1[int(graph_prev)]))
        return 1.0 / (1.0 + math.exp(-logit))


def load_markov_head(path: str | Path, hidden_size: int) -> MarkovHead | None:
    """The Markov head of a drafter GGUF (None if it has none), read with the bounded header reader."""
    from ...drafter_gguf import read_gguf_header  # here: drafter_gguf reads the kinds registry

    header = read_gguf_header(path)
    try:
        tensors = header.tensors
        if Tensors.MARKOV_W1 not in tensors:
            return None

        def read(name: str) -> np.ndarray:
            t = tensors[name]
            raw = np.frombuffer(header.buffer, dtype=np.uint8, count=t.nbytes, offset=t.offset).copy()
            if t.tensor_type == gguf.GGMLQuantizationType.I64:
                return raw.view(np.int64).reshape(tuple(reversed(t.shape)))
            shape = tuple(reversed(t.shape))  # numpy order
            return gguf.quants.dequantize(raw.reshape(shape[:-1] + (-1,)), t.tensor_type).reshape(shape).astype(np.float32)

        w1 = read(Tensors.MARKOV_W1)
        w2 = read(Tensors.MARKOV_W2)
        d2t = read(Tensors.D2T).reshape(-1) if Tensors.D2T in tensors else None
        conf = read(Tensors.CONF_PROJ).reshape(-1)[hidden_size:] if Tensors.CONF_PROJ in tensors else None
        return MarkovHead(w1=w1, w2=w2, d2t=d2t, conf_markov=conf)
    finally:
        try:
            header.buffer.close()
        except BufferError:
            pass


class DSparkHead(Head):
    """The graph's Markov-biased logits of each prediction slot, and (with a confidence head) each slot's
    predicted acceptance, broadcast across its nextn row."""


    def __init__(self, source: HeadSource) -> None:
        self.transforms = OutputTransforms(source)
        self.n_vocab = source.n_vocab
        # libllama builds the head where markov_w1 is present, the marker of this kind
        self.markov: MarkovHead = load_markov_head(source.path, source.n_embd)
        self.confidences = source.meta(Keys.HAS_CONFIDENCE_HEAD) != "false" and self.markov.conf_markov is not None
        self.nextn = self.confidences  # the confidences come back through the unmasked nextn rows

    def rows(self, logits: np.ndarray | None, nextn: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        # the Markov chain needs the untransformed rows; propose() applies the transforms
        return logits, None if nextn is None else nextn[:, 0].copy()

    def condition(self, row: np.ndarray, graph_prev: int, prev: int) -> np.ndarray:
        """The Markov bias of `graph_prev` moved to `prev`'s (a copy; the row itself if they are equal)."""
        return self.markov.correct(row, graph_prev, prev)

    def tree_candidates(self, rows: np.ndarray, anchor: int, k: int) -> "MarkovCandidates":
        """A node's children from its slot's row re-biased on the node's own token (every node re-runs the head)."""
        return MarkovCandidates(rows, anchor, self.markov, self.transforms, k)

    def propose(self, rows: np.ndarray, confidences: np.ndarray | None, last_token: int, params: SamplingParams,
                rng: np.random.Generator) -> Proposal:
        """The graph chained each slot's Markov bias on the previous slot's argmax (the anchor first).

        Greedy drafts are that chain. A sampled draft re-conditions each slot on the token actually drawn
        before it (DeepSpec's semantics), and the row it is then drawn from is the q it reports, so rejection
        sampling sees exactly the proposal used. Confidences are rescored the same way.
        """
        conf = confidences
        if params.greedy:
            tokens = rows.argmax(axis=1)
            return Proposal(tokens=tokens, confidences=None if conf is None else conf.copy())
        head = self.markov
        n = rows.shape[0]
        tokens = np.empty(n, dtype=np.int64)
        q = np.empty((n, self.n_vocab), dtype=np.float64)
        out_conf = None if conf is None else np.empty(n, dtype=np.float64)
        graph_prev = prev = int(last_token)
        for i in range(n):
            row = self.condition(rows[i], graph_prev, prev)
            if out_conf is not None:
                out_conf[i] = head.correct_confidence(conf[i], graph_prev, prev)
            q[i] = probabilities(self.transforms(row[None]), params)[0]
            tokens[i] = sample_token(q[i], rng)
            graph_prev, prev = int(rows[i].argmax()), int(tokens[i])
        return Proposal(tokens=tokens, q=q, confidences=out_conf)


class MarkovCandidates:
    """DSpark: the graph biased slot i's logits with its Markov head on the previous slot's argmax (the anchor
    before slot 1); a node's children are that row re-biased on the node's own token (MarkovHead.correct), as
    a sampled DSpark draft re-conditions on the token drawn, so every node re-runs the head. The rows are the
    drafter's output view: the tree is grown before the drafter runs again."""

    def __init__(self, rows: np.ndarray, anchor: int, head: "MarkovHead | None",
                 transform: Callable[[np.ndarray], np.ndarray], k: int) -> None:
        self.rows, self.head, self.transform, self.k = rows, head, transform, k
        self.n_slots = rows.shape[0]
        self.graph_prev = [int(anchor)] + [int(r.argmax()) for r in rows[:-1]]  # what the graph conditioned on

    def after(self, depth: int, token: int) -> tuple[np.ndarray, np.ndarray]:
        row = self.rows[depth]
        if self.head is not None:
            row = self.head.correct(row, self.graph_prev[depth], int(token))
        return top_row(self.transform(np.asarray(row)[None])[0], self.k)

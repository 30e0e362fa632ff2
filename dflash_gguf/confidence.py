"""DSpark's Markov head and confidence head on the host, and the confidence cut of a drafted block.

libllama's graph (src/models/dflash.cpp, build_dspark_markov_head) biases each block position's
logits by `W2 @ W1[prev]` and scores `sigmoid(c . [hidden; W1[prev]] + b)`, where `prev` is the
previous position's *argmax* (the anchor for the first). That is exact for greedy drafting. A
sampled draft conditions the next position on the token really drawn (DeepSpec's
`sample_block_tokens`), so `MarkovHead.correct` moves a row from the argmax's bias to the sampled
token's: the q a token is drawn from, and handed to rejection sampling, is that corrected row.

Each confidence is the predicted probability that a position is accepted *given* every earlier
one was (DeepSpec scores the cumulative product against the accepted prefix), so:
- `confident_prefix` cuts a block at the first position whose confidence is below a threshold
  (upstream's `--spec-draft-p-min`, DeepSpec's `_confident_prefix_length`);
- `expected_committed` turns confidences into expected committed tokens per verify length,
  and `best_verify_length` picks the length with the most expected tokens per second under a
  verify cost table, the cost model the block controller keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import gguf
import numpy as np

from .schema import Tensors

_EPS = 1e-7


def check_threshold(threshold: float) -> float:
    """A confidence threshold must be a number in [0, 1]; 0 never cuts."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= float(threshold) <= 1.0:
        raise ValueError(f"confidence threshold must be a number in [0, 1], got {threshold!r}")
    return float(threshold)


def confident_prefix(confidences: Sequence[float] | np.ndarray, threshold: float) -> int:
    """How many leading drafts to keep: up to (not including) the first whose confidence < threshold.

    A threshold of 0 keeps everything. The result may be 0: the caller then decodes plainly
    (upstream drops such a draft).
    """
    threshold = check_threshold(threshold)
    c = np.asarray(confidences, dtype=np.float64)
    if threshold <= 0.0:
        return int(c.size)
    below = np.flatnonzero(c < threshold)
    return int(below[0]) if below.size else int(c.size)


def expected_committed(confidences: Sequence[float] | np.ndarray) -> np.ndarray:
    """E[tokens committed] by verifying the first n drafts, n = 0..len: 1 + sum_{j<=n} prod_{i<=j} c_i.

    The bonus token (the target's own next token) is always committed, hence the 1.
    """
    c = np.clip(np.asarray(confidences, dtype=np.float64), 0.0, 1.0)
    return np.concatenate([[1.0], 1.0 + np.cumsum(np.cumprod(c))])


def best_verify_length(
    confidences: Sequence[float] | np.ndarray,
    verify_s: Callable[[int], float] | Mapping[int, float],
    *,
    draft_s: float = 0.0,
    threshold: float = 0.0,
) -> int:
    """The number of drafts to verify that maximises expected committed tokens per second.

    `verify_s(n_tokens)` is the measured cost of a target batch of n_tokens (last + n drafts; the
    controller's `CostModel.verify_s`), `draft_s` what this block already cost to draft (the same for
    every length: it changes the rates, not only their order). The candidates stop at the threshold cut.
    Returns 0 when even one draft does not beat a plain step (expected 1 token for verify_s(1)).
    """
    cost = verify_s if callable(verify_s) else (lambda n, table=dict(verify_s): _table_cost(table, n))
    n_max = confident_prefix(confidences, threshold)
    expected = expected_committed(confidences)
    best_n, best_rate = 0, 1.0 / max(cost(1), 1e-12)
    for n in range(1, n_max + 1):
        rate = expected[n] / max(draft_s + cost(n + 1), 1e-12)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def _table_cost(table: dict[int, float], n: int) -> float:
    """Linear interpolation in a {n_tokens: seconds} table (extrapolated from the last two points)."""
    if n in table:
        return table[n]
    sizes = sorted(table)
    lo = max((s for s in sizes if s < n), default=sizes[0])
    hi = min((s for s in sizes if s > n), default=sizes[-1])
    if lo == hi:
        if len(sizes) >= 2 and n > sizes[-1]:
            a, b = sizes[-2], sizes[-1]
            return table[b] + (table[b] - table[a]) / (b - a) * (n - b)
        return table[lo]
    return table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)


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
    from .drafter_gguf import read_gguf_header

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

"""The confidence cut of a drafted block (DSpark's Markov head on the host is its kind's, kinds/dspark/head.py).

Each confidence is the predicted probability that a position is accepted *given* every earlier
one was (DeepSpec scores the cumulative product against the accepted prefix), so:
- `confident_prefix` cuts a block at the first position whose confidence is below a threshold
  (upstream's `--spec-draft-p-min`, DeepSpec's `_confident_prefix_length`);
- `expected_committed` turns confidences into expected committed tokens per verify length,
  and `best_verify_length` picks the length with the most expected tokens per second under a
  verify cost table, the cost model the block controller keeps.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np


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

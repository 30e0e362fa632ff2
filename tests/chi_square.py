"""Pearson's χ² test of sampled tokens against an exact distribution, shared by the sampling tests."""

from __future__ import annotations

from collections import Counter

import numpy as np

def chi_square_p_value(samples: list[int], probs: np.ndarray) -> float:
    """Pearson's test over tokens expected >= 5 times, the rest pooled into one cell."""
    n = len(samples)
    counts = Counter(samples)
    big = [int(t) for t in np.flatnonzero(probs * n >= 5)]
    observed = [counts.get(t, 0) for t in big]
    expected = [probs[t] * n for t in big]
    rest_expected = n - sum(expected)
    if rest_expected > 1e-9:
        observed.append(n - sum(observed))
        expected.append(rest_expected)
    elif n - sum(observed) > 0:
        return 0.0  # tokens outside the support were sampled
    if len(observed) == 1:
        return 1.0  # a single token carries all the mass, and every sample is that token
    o, e = np.array(observed, dtype=np.float64), np.array(expected)
    stat = float(((o - e) ** 2 / e).sum())
    dof = len(o) - 1
    import torch  # the regularised upper incomplete gamma: the χ² survival function

    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))

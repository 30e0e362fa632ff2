"""Sampling parameters and the token distribution they define over a row of logits.

Pure numpy: the same distribution feeds the drafter's proposals and the target's verification,
so speculative rejection sampling reproduces exactly what plain sampling from the target would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import checked, integer, optional, real

# Nucleus search starts from this many candidates and widens 4x until the kept mass reaches top_p:
# typical nuclei are far smaller than the vocabulary, so a full sort of V logits is rarely needed.
_NUCLEUS_FIRST_CANDIDATES = 1024


# each sampling setting's check, shared with GenerationConfig (config.py)
CHECKS = {
    "temperature": real(0.0, note=" (0 = greedy)"),
    "top_p": real(0.0, 1.0, low_open=True),
    "top_k": integer(0, " (0 = off)"),
    "seed": optional(integer(0), "fresh entropy"),
}


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; temperature 0 means greedy (argmax), which ignores the rest.

    Validated on construction, so an instance in hand is always usable.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise SettingError (a ValueError) naming the first bad field and its value."""
        for name, check in CHECKS.items():
            checked(name, check, getattr(self, name))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> np.random.Generator:
        """A generator seeded from `seed`; fresh OS entropy when seed is None."""
        return np.random.default_rng(None if self.seed is None else int(self.seed))


def _softmax_(scores: np.ndarray, temperature: float) -> np.ndarray:
    """Row-wise softmax of scores / temperature, in place on a float64 array.

    Subtracting the row max first keeps exp() from overflowing; dividing after it keeps a
    vanishing temperature from turning the max into 0 * inf.
    """
    scores -= scores.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):  # a gap over a vanishing temperature is -inf: probability 0
        scores /= temperature
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def _nucleus_mask(sorted_probs: np.ndarray, top_p: float) -> np.ndarray:
    """Keep a token when the mass strictly before it is below top_p: the smallest prefix reaching top_p."""
    return np.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p


def _apply_top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Nucleus filter over each row, sorting only as many candidates as the nucleus needs."""
    rows, vocab = probs.shape
    m = min(vocab, _NUCLEUS_FIRST_CANDIDATES)
    while True:
        if m < vocab:
            candidates = np.argpartition(probs, vocab - m, axis=-1)[:, vocab - m :]
        else:
            candidates = np.broadcast_to(np.arange(vocab), (rows, vocab))
        mass = np.take_along_axis(probs, candidates, axis=-1)
        # Once the m largest already reach top_p, no token outside them can belong to the nucleus.
        if m == vocab or bool(np.all(mass.sum(axis=-1) >= top_p)):
            break
        m = min(vocab, 4 * m)
    order = np.argsort(-mass, axis=-1, kind="stable")
    sorted_probs = np.take_along_axis(mass, order, axis=-1)
    sorted_ids = np.take_along_axis(candidates, order, axis=-1)
    kept = np.where(_nucleus_mask(sorted_probs, top_p), sorted_probs, 0.0)
    out = np.zeros_like(probs)
    np.put_along_axis(out, sorted_ids, kept, axis=-1)
    return out / out.sum(axis=-1, keepdims=True)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution `params` samples from: logits / temperature, top-k, softmax, then top-p.

    logits (..., V) -> float64 (..., V), each row summing to 1; tokens cut by top-k/top-p get 0.
    Greedy params have no distribution (argmax the logits instead) and raise ValueError, as do
    logits with NaN or +inf, or a row that is entirely -inf. -inf marks a banned token.
    """
    if params.greedy:
        raise ValueError("temperature 0 is greedy decoding: take the argmax of the logits, not probabilities")
    x = np.asarray(logits)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(f"logits must have shape (..., V) with V > 0, got {x.shape}")
    if not np.issubdtype(x.dtype, np.number) or np.iscomplexobj(x):
        raise ValueError(f"logits must be real numbers, got dtype {x.dtype}")
    vocab = x.shape[-1]
    rows = x.reshape(-1, vocab)
    row_max = rows.max(axis=-1)  # NaN propagates through max, so one pass checks every logit
    if np.isnan(row_max).any() or np.isposinf(row_max).any():
        raise ValueError("logits contain NaN or +inf")
    if np.isneginf(row_max).any():
        raise ValueError("every logit of a row is -inf: no token can be sampled")

    temperature = float(params.temperature)
    top_k = int(params.top_k)
    top_p = float(params.top_p)
    if 0 < top_k < vocab:
        # temperature > 0 preserves the order, so the k largest logits are the k largest scores
        ids = np.argpartition(rows, vocab - top_k, axis=-1)[:, vocab - top_k :]
        probs = _softmax_(np.take_along_axis(rows, ids, axis=-1).astype(np.float64), temperature)
        if top_p < 1.0:
            probs = _apply_top_p(probs, top_p)
        out = np.zeros(rows.shape, dtype=np.float64)
        np.put_along_axis(out, ids, probs, axis=-1)
    else:
        out = _softmax_(rows.astype(np.float64), temperature)
        if top_p < 1.0:
            out = _apply_top_p(out, top_p)
    return out.reshape(x.shape)


def sample_token(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a (V,) distribution by inverting its CDF (never a zero-probability id)."""
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 1 or p.size == 0:
        raise ValueError(f"probs must be a non-empty (V,) vector, got shape {p.shape}")
    cdf = np.cumsum(p)
    total = cdf[-1]
    if not np.isfinite(total) or total <= 0 or p.min() < 0:
        raise ValueError("probs must be finite, non-negative and have positive mass")
    # u in [0, 1) keeps u*total < total; side="right" skips ids whose CDF step is empty (p = 0)
    return int(np.searchsorted(cdf, rng.random() * total, side="right"))

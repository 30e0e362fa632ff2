"""Sampling parameters and the token distribution they define over a row of logits.

Pure numpy: the same distribution feeds the drafter's proposals and the target's verification,
so speculative rejection sampling reproduces exactly what plain sampling from the target would.
The chain is llama-cpp-python's (Llama._init_sampler) and llama.cpp's default: logit_bias, penalties,
top-k, top-p, min-p, then temperature; top-p and min-p judge the untempered distribution.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .checks import SettingError, checked, integer, is_integer, is_real, optional, real

# Nucleus search starts from this many candidates and widens 4x until the kept mass reaches top_p:
# typical nuclei are far smaller than the vocabulary, so a full sort of V logits is rarely needed.
_NUCLEUS_FIRST_CANDIDATES = 1024


def _finite(value: Any) -> float:
    if not is_real(value) or not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value!r}")
    return float(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """{token id: bias} (ids as ints or decimal strings, as JSON sends them), or its normalised form: sorted
    (id, bias) pairs. A bias is a finite number, or -inf to ban the token."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(i, (list, tuple)) and len(i) == 2 for i in value):
        items = list(value)
    else:
        raise TypeError(f"must be a {{token id: bias}} mapping, got {value!r}")
    out: dict[int, float] = {}
    for key, bias in items:
        if isinstance(key, str) and key.strip().isdigit():
            key = int(key)
        if not is_integer(key) or key < 0:
            raise ValueError(f"keys must be token ids (integers >= 0), got {key!r}")
        if not is_real(bias) or math.isnan(bias) or bias == math.inf:
            raise ValueError(f"token {key}: a bias must be a finite number or -inf, got {bias!r}")
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


# each sampling setting's check, shared with GenerationConfig (config.py)
CHECKS = {
    "temperature": real(0.0, note=" (0 = greedy)"),
    "top_p": real(0.0, 1.0, low_open=True),
    "top_k": integer(0, " (0 = off)"),
    "min_p": real(0.0, 1.0, note=" (0 = off)"),
    "repeat_penalty": real(0.0, low_open=True, note=" (1 = off)"),
    "repeat_last_n": integer(-1, " (-1 = the whole reply, 0 = no penalties)"),
    "presence_penalty": _finite,
    "frequency_penalty": _finite,
    "logit_bias": _logit_bias,
    "seed": optional(integer(0), "fresh entropy"),
}


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; temperature 0 means greedy (argmax of the biased, penalised logits).

    Validated (and normalised: logit_bias becomes sorted (id, bias) pairs) on construction, so an
    instance in hand is always usable. Penalties count the reply's own tokens, the last repeat_last_n
    of them, as llama-cpp-python's Llama does (llama.cpp's penalties sampler, fed the sampled tokens).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise SettingError (a ValueError) naming the first bad field and its value."""
        for name, check in CHECKS.items():
            object.__setattr__(self, name, checked(name, check, getattr(self, name)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes(self) -> bool:
        """Whether the history changes the logits (llama.cpp's penalties sampler is not a no-op)."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)

    @property
    def adjusts(self) -> bool:
        """Whether any logit is changed before the chain's filters (a bias, or a penalty)."""
        return bool(self.logit_bias) or self.penalizes

    def check_vocab(self, n_vocab: int) -> None:
        """Raise SettingError naming logit_bias if it names a token outside a vocabulary of n_vocab, or bans them all."""
        bad = [t for t, _ in self.logit_bias if t >= n_vocab]
        if bad:
            raise SettingError("logit_bias", f"token id {bad[0]} is outside the vocabulary of {n_vocab}")
        if sum(1 for _, bias in self.logit_bias if bias == -math.inf) >= n_vocab:
            raise SettingError("logit_bias", f"bans every token of the vocabulary of {n_vocab}: nothing could be generated")

    def window(self, history: Sequence[int], n_ctx: int) -> Sequence[int]:
        """The tokens the penalties count: the last repeat_last_n of the history (-1: up to n_ctx of them)."""
        n = n_ctx if self.repeat_last_n < 0 else self.repeat_last_n
        return history[max(0, len(history) - n):] if n else history[:0]

    def rng(self) -> np.random.Generator:
        """A generator seeded from `seed`; fresh OS entropy when seed is None."""
        return np.random.default_rng(None if self.seed is None else int(self.seed))


def adjusted_logits(logits: np.ndarray, params: SamplingParams, windows: Sequence[Sequence[int]] = ()) -> np.ndarray:
    """Rows of logits (k, V) with logit_bias added, then llama.cpp's penalties over windows[i] for row i.

    As llama.cpp does, in float32: a repeated token's logit is divided by repeat_penalty (multiplied when
    <= 0), then lowered by count * frequency_penalty + presence_penalty. Returns the input itself when
    nothing applies, else a float32 copy (a banned -inf stays -inf). windows: one per row, or none at all.
    """
    if not params.adjusts:
        return logits
    out = np.array(logits, dtype=np.float32)
    if out.ndim != 2:
        raise ValueError(f"logits must have shape (k, V), got {out.shape}")
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)
        if ids.max() >= out.shape[1]:
            raise ValueError(f"logit_bias: token id {int(ids.max())} is outside the vocabulary of {out.shape[1]}")
        out[:, ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float32)
    if params.penalizes and windows:
        if len(windows) != out.shape[0]:
            raise ValueError(f"need one penalty window per row: {out.shape[0]} rows, {len(windows)} windows")
        repeat = np.float32(params.repeat_penalty)
        freq, present = np.float32(params.frequency_penalty), np.float32(params.presence_penalty)
        for row, window in zip(out, windows):
            if len(window) == 0:
                continue
            ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
            x = row[ids]
            x = np.where(x <= 0, x * repeat, x / repeat)
            row[ids] = x - (counts.astype(np.float32) * freq + present)
    return out


def greedy_tokens(logits: np.ndarray) -> np.ndarray:
    """Each row's argmax, refusing a row with nothing left to choose (every logit -inf)."""
    x = np.asarray(logits)
    best = x.argmax(axis=-1)
    if np.isneginf(np.take_along_axis(x, best[..., None], axis=-1)).any():
        raise ValueError("every logit of a row is -inf (logit_bias or a constraint banned them all)")
    return best


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


def _top_p_keep(probs: np.ndarray, top_p: float) -> np.ndarray:
    """(rows, V) bool: the nucleus of each row, sorting only as many candidates as the nucleus needs."""
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
    keep = np.zeros(probs.shape, dtype=bool)
    np.put_along_axis(keep, sorted_ids, _nucleus_mask(sorted_probs, top_p), axis=-1)
    return keep


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution `params` samples from: top-k, top-p, min-p, then softmax of logits / temperature.

    As llama.cpp's chain: top-p keeps the smallest set reaching top_p of the untempered distribution,
    min-p the tokens with at least min_p times the likeliest one's untempered probability; the kept
    tokens are then weighted by softmax(logit / temperature). Bias and penalties come before this
    (adjusted_logits). logits (..., V) -> float64 (..., V), each row summing to 1; cut tokens get 0.
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

    top_k, top_p, min_p = int(params.top_k), float(params.top_p), float(params.min_p)
    ids = None
    if 0 < top_k < vocab:
        ids = np.argpartition(rows, vocab - top_k, axis=-1)[:, vocab - top_k :]
        scores = np.take_along_axis(rows, ids, axis=-1).astype(np.float64)
    else:
        scores = rows.astype(np.float64)
    if top_p < 1.0 or min_p > 0.0:
        keep = np.ones(scores.shape, dtype=bool)
        if top_p < 1.0:
            keep &= _top_p_keep(_softmax_(scores.copy(), 1.0), top_p)
        if min_p > 0.0:  # the likeliest token is in every nucleus, so its logit is still the row max
            keep &= scores - scores.max(axis=-1, keepdims=True) >= math.log(min_p)
        scores[~keep] = -np.inf
    probs = _softmax_(scores, float(params.temperature))
    if ids is not None:
        out = np.zeros(rows.shape, dtype=np.float64)
        np.put_along_axis(out, ids, probs, axis=-1)
        probs = out
    return probs.reshape(x.shape)


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], n_top: int) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """For row i of raw logits: (log-softmax at tokens[i], the n_top likeliest (id, logprob), likeliest first).

    The model's own log-probabilities (what `logprobs` reports); only the entries asked for are formed, the
    normaliser summed in float64 over float32 exponentials.
    """
    x = np.asarray(logits, dtype=np.float32)[: len(tokens)]
    vocab = x.shape[-1]
    peak = x.max(axis=-1, keepdims=True)
    lse = peak[:, 0].astype(np.float64) + np.log(np.exp(x - peak).sum(axis=-1, dtype=np.float64))
    k = min(n_top, vocab)
    out = []
    for row, norm, token in zip(x, lse, tokens):
        top: tuple[tuple[int, float], ...] = ()
        if k:
            ids = np.argpartition(row, vocab - k)[vocab - k :]
            ids = ids[np.argsort(-row[ids], kind="stable")]
            top = tuple((int(i), float(row[i]) - float(norm)) for i in ids)
        out.append((float(row[int(token)]) - float(norm), top))
    return out


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

"""Which drafted tokens the target accepts, and the token it commits after them.

Greedy verification keeps the longest prefix the target's argmax agrees with; sampled verification
is speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023), whose committed tokens
are distributed exactly as if sampled from the target alone.
"""

from __future__ import annotations

import numpy as np

from dflash_gguf.sampling import sample_token


def _token_ids(name: str, values: np.ndarray, ndim: int) -> np.ndarray:
    """An integer array of the given rank; an empty input of any dtype counts as no tokens."""
    a = np.asarray(values)
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {a.shape}")
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token ids, got dtype {a.dtype}")
    return a.astype(np.int64, copy=False)


def accept_greedy(draft: np.ndarray, target_argmax: np.ndarray) -> tuple[int, int]:
    """(n_accepted, bonus): the longest prefix with draft[i] == target_argmax[i], then the target's own token.

    draft (n,), target_argmax (n+1,): row i is the target's choice after the prefix ending at draft[i-1].
    """
    d = _token_ids("draft", draft, 1)
    t = _token_ids("target_argmax", target_argmax, 1)
    if t.shape[0] != d.shape[0] + 1:
        raise ValueError(f"target_argmax needs len(draft) + 1 = {d.shape[0] + 1} entries, got {t.shape[0]}")
    mismatch = np.flatnonzero(d != t[:-1])
    n_accepted = int(mismatch[0]) if mismatch.size else int(d.shape[0])
    return n_accepted, int(t[n_accepted])


def _check_probs(name: str, values: np.ndarray, rows: int) -> np.ndarray:
    a = np.asarray(values)
    if a.ndim != 2 or a.shape[0] != rows or a.shape[1] == 0:
        raise ValueError(f"{name} must have shape ({rows}, V) with V > 0, got {a.shape}")
    if a.dtype.kind != "f":
        raise ValueError(f"{name} must hold floating-point probabilities, got dtype {a.dtype}")
    return a


def _check_mass(name: str, values: np.ndarray) -> None:
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise ValueError(f"{name} must be finite and non-negative at the drafted tokens")


def accept_sampled(
    draft: np.ndarray,
    draft_probs: np.ndarray,
    target_probs: np.ndarray,
    rng: np.random.Generator,
    *,
    draft_indices: np.ndarray | None = None,
) -> tuple[int, int]:
    """(n_accepted, next_token) by speculative rejection sampling.

    draft (n,) tokens, each drawn from its row of the draft distribution q; target_probs (n+1, V) the
    target's p at each block slot. draft[i] is kept with probability min(1, p_i(x)/q_i(x)); at the first
    rejection next_token ~ normalize(max(p_i - q_i, 0)) (p_i itself when that residual has no mass),
    and when all n are kept next_token ~ p_n. q is dense (n, V), or sparse: draft_probs (n, k) over the
    token ids draft_indices (n, k), as DFlash2's selector yields. A drafted token with q = 0 is kept
    whenever p > 0, so the result stays exact even for a draft that strayed outside its support.
    """
    d = _token_ids("draft", draft, 1)
    n = d.shape[0]
    p = _check_probs("target_probs", target_probs, n + 1)
    vocab = p.shape[1]
    if draft_indices is None:
        q = _check_probs("draft_probs", draft_probs, n)
        if q.shape[1] != vocab:
            raise ValueError(f"draft_probs has {q.shape[1]} columns but target_probs has {vocab}")
        ids = None
    else:
        ids = _token_ids("draft_indices", draft_indices, 2)
        q = np.asarray(draft_probs)
        if ids.shape[0] != n or q.shape != ids.shape:
            raise ValueError(f"sparse draft_probs and draft_indices must both be ({n}, k), got {q.shape} and {ids.shape}")
        if q.dtype.kind != "f":
            raise ValueError(f"draft_probs must hold floating-point probabilities, got dtype {q.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"draft_indices must be token ids in [0, {vocab})")
    if n and (d.min() < 0 or d.max() >= vocab):
        raise ValueError(f"draft tokens must be ids in [0, {vocab}), got {d.tolist()}")

    rows = np.arange(n)
    p_drafted = p[rows, d].astype(np.float64)
    if ids is None:
        q_drafted = q[rows, d].astype(np.float64)
    else:
        q_drafted = np.where(ids == d[:, None], q, 0.0).sum(axis=-1, dtype=np.float64)
    _check_mass("target_probs", p_drafted)
    _check_mass("draft_probs", q_drafted)

    # u < p/q written as u*q < p: no division, and q = 0 accepts exactly when p > 0.
    kept = rng.random(n) * q_drafted < p_drafted
    rejected = np.flatnonzero(~kept)
    if rejected.size == 0:
        return n, sample_token(p[n], rng)

    i = int(rejected[0])
    target_row = p[i].astype(np.float64)
    residual = target_row.copy()
    if ids is None:
        residual -= q[i]
    else:
        np.subtract.at(residual, ids[i], q[i].astype(np.float64))
    np.maximum(residual, 0.0, out=residual)
    mass = residual.sum()
    if not np.isfinite(mass):
        raise ValueError(f"draft_probs row {i} or target_probs row {i} is not finite")
    return i, sample_token(residual if mass > 0 else target_row, rng)

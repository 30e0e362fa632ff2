"""Which drafted tokens the target accepts, the token it commits after them, and what a source learns of it.

Greedy verification keeps the longest prefix the target's argmax agrees with; sampled verification
is speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023), whose committed tokens
are distributed exactly as if sampled from the target alone. `AcceptanceProfile` is how every draft source
learns how often its drafts pass (each owns one), and so what each length of its next draft is expected to commit.
"""

from __future__ import annotations

from typing import Callable, Sequence

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


class AcceptanceProfile:
    """P(the draft at position p passes | the drafts before it passed), learnt from the cycles a source drafted.

    Positions map to slots (`slot_of`; the position itself by default): the drafter learns per draft slot,
    lookup per bucket of the match length a draft continues (and MTP on lookup's buckets from one start). Each
    slot keeps decayed Beta counts shrunk towards a prior: `prior` per slot (or one for all), or, with `pooled`,
    towards the rate of every slot's counts together, itself shrunk towards `prior` with strength `pooled`, so a
    few cycles are enough to react and slots never tried borrow from those that were. Evidence fades by `memory`
    per step of the owner's clock: `at`, the cycle it counts (the drafter's controller: a plain streak fades its
    profile, so a probe after one counts), or by default one step per observation.
    """

    def __init__(self, slots: int, *, prior: float | Sequence[float], strength: float, memory: float,
                 pooled: float | None = None, slot_of: Callable[[int], int] | None = None) -> None:
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        priors = [float(prior)] * slots if isinstance(prior, (int, float)) else [float(p) for p in prior]
        if len(priors) != slots or not all(0.0 < p < 1.0 for p in priors):
            raise ValueError(f"prior must be one rate or {slots} rates, each in (0, 1), got {prior!r}")
        if pooled is not None and len(set(priors)) != 1:
            raise ValueError("a pooled profile shrinks its pooled rate towards one prior rate")
        if strength <= 0.0 or (pooled is not None and pooled <= 0.0):
            raise ValueError(f"strength and pooled must be > 0, got {strength}, {pooled}")
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"memory must be in (0, 1], got {memory}")
        self.slots = slots
        self._prior = priors
        self._strength = strength
        self._pooled = pooled
        self._memory = memory
        self._slot_of = slot_of
        self._accepted = [0.0] * slots  # decayed count of judged drafts that passed, per slot
        self._tried = [0.0] * slots  # decayed count of drafts judged, per slot
        self._at = 0  # the clock when the counts were last decayed

    def _decay(self, at: int | None) -> float:
        return 1.0 if at is None else self._memory ** max(0, at - self._at)

    def _pooled_rate(self, decay: float) -> float:
        """Every slot's counts together, shrunk towards the prior (a pooled profile's slots shrink towards it)."""
        pooled = self._pooled
        return (sum(self._accepted) * decay + pooled * self._prior[0]) / (sum(self._tried) * decay + pooled)

    def _targets(self, decay: float) -> list[float]:
        """What each slot's rate is shrunk towards: its prior, or the pooled rate."""
        return self._prior if self._pooled is None else [self._pooled_rate(decay)] * self.slots

    def _rate(self, slot: int, decay: float, target: float) -> float:
        s = self._strength
        return (self._accepted[slot] * decay + s * target) / (self._tried[slot] * decay + s)

    def rates(self, at: int | None = None) -> list[float]:
        """Every slot's P(pass | the drafts before passed), as estimated at the owner's clock `at`."""
        decay = self._decay(at)
        s = self._strength
        if self._pooled is None:
            return [(a * decay + s * p) / (t * decay + s) for a, t, p in zip(self._accepted, self._tried, self._prior)]
        pooled = self._pooled_rate(decay)  # the drafter's, every cycle: one pass, no call per slot
        return [(a * decay + s * pooled) / (t * decay + s) for a, t in zip(self._accepted, self._tried)]

    def acceptance(self, position: int, at: int | None = None) -> float:
        """P(the draft at `position` passes | the drafts before it passed)."""
        slot, decay = self._slot(position), self._decay(at)
        return self._rate(slot, decay, self._targets(decay)[slot])

    def expected_tokens(self, start: int, n_max: int, at: int | None = None) -> list[float]:
        """Expected tokens a cycle verifying n drafts at positions start.. commits, n = 0..n_max (the bonus
        token included, so the first is 1)."""
        expected = [1.0]
        all_passed = 1.0
        if self._slot_of is None and not start and n_max == self.slots:  # the drafter's, every cycle
            for p in self.rates(at):
                all_passed *= p
                expected.append(expected[-1] + all_passed)
            return expected
        decay = self._decay(at)  # a few slots of many (lookup's buckets): each computed once, as reached
        targets = self._targets(decay)
        last, p = -1, 0.0
        for j in range(n_max):
            slot = self._slot(start + j)
            if slot != last:
                p, last = self._rate(slot, decay, targets[slot]), slot
            all_passed *= p
            expected.append(expected[-1] + all_passed)
        return expected

    def observe(self, start: int, n_drafted: int, n_accepted: int, at: int | None = None) -> None:
        """A cycle verified n_drafted drafts at positions start.. and the first n_accepted passed: those are
        learnt as passed and the next one, if drafted, as failed. at: the owner's clock (None: one step on)."""
        if not 0 <= n_accepted <= n_drafted:
            raise ValueError(f"need 0 <= n_accepted <= n_drafted, got {n_accepted}, {n_drafted}")
        n_judged = min(n_accepted + 1, n_drafted)
        if self._slot_of is None:  # the drafter's, every cycle: no call per slot
            if start < 0 or start + n_judged > self.slots:
                raise ValueError(f"positions {start}..{start + n_judged - 1} are outside the profile's "
                                 f"{self.slots} slots")
            judged: Sequence[int] = range(start, start + n_judged)
        else:
            judged = list(map(self._slot_of, range(start, start + n_judged)))
            if judged and (min(judged) < 0 or max(judged) >= self.slots):
                raise ValueError(f"positions {start}.. map outside the profile's {self.slots} slots")
        at = self._at + 1 if at is None else at
        decay = self._memory ** max(0, at - self._at)
        accepted = self._accepted = [a * decay for a in self._accepted]
        tried = self._tried = [t * decay for t in self._tried]
        for slot in judged[:n_accepted]:
            accepted[slot] += 1.0
            tried[slot] += 1.0
        if n_accepted < n_drafted:
            tried[judged[n_accepted]] += 1.0
        self._at = at

    def judged(self) -> bool:
        """Whether any draft has been judged (and not yet faded to nothing)."""
        return any(self._tried)

    def _slot(self, position: int) -> int:
        slot = position if self._slot_of is None else self._slot_of(position)
        if not 0 <= slot < self.slots:
            raise ValueError(f"position {position} is outside the profile's {self.slots} slots")
        return slot

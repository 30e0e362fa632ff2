"""The DFlash training recipe: where blocks start, what each block sees, what each slot predicts.

It mirrors inference exactly. At inference a block is `[last accepted token, mask x (B-1)]` at
positions `anchor .. anchor+B-1`, drafted from the target features of positions `< anchor`; slot k
proposes the token at `anchor + k`. Training packs many such blocks into one sequence: each block
sees the context strictly before its anchor and itself (bidirectionally), never another block.
"""

from __future__ import annotations

import math

import numpy as np

import torch

from ..kinds import kind_named
from ..kinds.training import IGNORE  # shared with the kinds' own losses


def valid_anchors(n_tokens: int, n_features: int, response_start: int) -> np.ndarray:
    """Positions that can anchor a block: in the response, with context features before them
    (anchor <= n_features) and at least one later token to predict (anchor <= n_tokens - 2)."""
    first = max(response_start, 1)
    last = min(n_features, n_tokens - 2)
    return np.arange(first, last + 1, dtype=np.int64) if last >= first else np.zeros(0, dtype=np.int64)


def sample_anchors(candidates: np.ndarray, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Up to `n_blocks` distinct anchors drawn uniformly from `candidates`, sorted."""
    if len(candidates) <= n_blocks:
        return np.sort(candidates)
    return np.sort(rng.choice(candidates, size=n_blocks, replace=False))


def block_inputs(tokens: np.ndarray, anchors: np.ndarray, block_size: int, mask_token_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(input ids, positions), each (n_blocks * block_size,): `[tokens[a], mask...]` at `a .. a+B-1`."""
    ids = np.full((len(anchors), block_size), mask_token_id, dtype=np.int64)
    ids[:, 0] = tokens[anchors]
    positions = anchors[:, None] + np.arange(block_size, dtype=np.int64)[None, :]
    return ids.reshape(-1), positions.reshape(-1)


def label_shift(kind: str) -> int:
    """Where slot k's label sits relative to `anchor + k`: DFlash and DFlash 2 label slot k with the
    token at its own position (slot 0, the anchor, is given); DSpark's slot k predicts the token
    after its position (DeepSpec: labels at anchor + 1 .. anchor + B, slot 0 included)."""
    return kind_named(kind).label_shift


def label_positions(anchors: np.ndarray, block_size: int, shift: int = 0) -> np.ndarray:
    """(n_blocks, block_size) token index each slot predicts."""
    return anchors[:, None] + shift + np.arange(block_size, dtype=np.int64)[None, :]


def block_labels(tokens: np.ndarray, anchors: np.ndarray, block_size: int, t2d: np.ndarray | None = None, shift: int = 0) -> np.ndarray:
    """(n_blocks * block_size,) labels: slot k of the block at `a` is `tokens[a + k + shift]`;
    positions past the end are IGNORE, and so is slot 0 when shift is 0 (it is the given anchor).
    With `t2d` (target id -> draft row, -1 if absent) the labels are draft rows, and tokens outside
    the draft vocabulary are IGNORE."""
    pos = label_positions(anchors, block_size, shift)
    inside = pos < len(tokens)
    labels = np.where(inside, tokens[np.minimum(pos, len(tokens) - 1)], IGNORE)
    if shift == 0:
        labels[:, 0] = IGNORE
    if t2d is not None:
        scored = labels != IGNORE
        mapped = np.where(scored, t2d[np.where(scored, labels, 0)], IGNORE)
        labels = np.where(mapped < 0, IGNORE, mapped)
    return labels.reshape(-1)


def slot_weights(block_size: int, gamma: float, shift: int = 0) -> np.ndarray:
    """(block_size,) loss weight of each slot: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1;
    with shift 1 (DSpark, every slot predicts) exp(-k/gamma) for every slot, as DeepSpec weighs.

    Early slots matter most: a draft is accepted only up to its first miss.
    """
    k = np.arange(block_size, dtype=np.float64)
    if shift:
        return np.exp(-k / gamma)
    w = np.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def default_gamma(block_size: int) -> float:
    """The decay the paper uses per block size: 7 for 16, 5 for 10, 4 for 8 (linear in between)."""
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    if block_size in table:
        return table[block_size]
    return max(1.0, 7.0 * block_size / 16)


def attention_mask(n_context: int, context_len: int, anchors: np.ndarray, block_size: int) -> torch.Tensor:
    """Boolean (n_blocks*B, n_context + n_blocks*B) mask, True = may attend.

    Keys are `[context ; blocks]`. Block b's queries see context keys `j < anchors[b]` (and only
    the first `context_len` context rows are real) and the keys of block b itself.
    """
    n_blocks = len(anchors)
    q_block = np.repeat(np.arange(n_blocks), block_size)
    ctx_pos = np.arange(n_context)
    sees_ctx = (ctx_pos[None, :] < anchors[q_block][:, None]) & (ctx_pos[None, :] < context_len)
    sees_blk = q_block[:, None] == q_block[None, :]
    return torch.from_numpy(np.concatenate([sees_ctx, sees_blk], axis=1))


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean cross-entropy, slot accuracy) over scored slots.

    logits (N, V), labels (N,) with IGNORE, weights (N,) per slot.
    """
    scored = labels != IGNORE
    safe = torch.where(scored, labels, torch.zeros_like(labels))
    ce = torch.nn.functional.cross_entropy(logits.float(), safe, reduction="none")
    w = weights * scored
    loss = (ce * w).sum() / w.sum().clamp_min(1e-9)
    correct = ((logits.argmax(-1) == labels) & scored).sum()
    accuracy = correct.float() / scored.sum().clamp_min(1)
    return loss, accuracy


def expected_acceptance(slot_correct: np.ndarray) -> float:
    """τ estimate from per-block slot hits (n_blocks, B-1): 1 + mean length of the leading run
    of hits, i.e. what greedy verification would commit per cycle (bonus token included)."""
    if slot_correct.size == 0:
        return math.nan
    run = np.cumprod(slot_correct.astype(np.int64), axis=1).sum(axis=1)
    return float(1.0 + run.mean())


def soft_targets(soft_ids: torch.Tensor, soft_logits: torch.Tensor) -> torch.Tensor:
    """(N, k) probabilities of the target's top-k (softmax over the kept entries; ids < 0 dropped).
    A row with no kept entry is all zeros."""
    valid = soft_ids >= 0
    z = torch.where(valid, soft_logits.float(), torch.full_like(soft_logits.float(), -torch.inf))
    p = torch.softmax(z, dim=-1)
    return torch.where(valid, p, torch.zeros_like(p)).nan_to_num(0.0)


def soft_cross_entropy(logits: torch.Tensor, soft_ids: torch.Tensor, soft_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (cross-entropy against the target's top-k distribution, row has soft targets).

    logits (N, V) over the draft rows; soft_ids (N, k) draft rows or -1; soft_logits (N, k).
    """
    p = soft_targets(soft_ids, soft_logits)
    logq = torch.log_softmax(logits.float(), dim=-1).gather(-1, soft_ids.clamp_min(0))
    return -(p * logq).sum(-1), (soft_ids >= 0).any(-1)


def distill_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
    soft_ids: torch.Tensor | None, soft_logits: torch.Tensor | None, soft_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(1 - w) x hard-label cross-entropy + w x soft cross-entropy on the target's top-k, each
    slot-weighted over its scored rows; (loss, slot accuracy). w = 0 is `weighted_loss`."""
    hard, acc = weighted_loss(logits, labels, weights)
    if soft_weight <= 0 or soft_ids is None:
        return hard, acc
    ce, has = soft_cross_entropy(logits, soft_ids, soft_logits)
    w = weights * has
    soft = (ce * w).sum() / w.sum().clamp_min(1e-9)
    return (1 - soft_weight) * hard + soft_weight * soft, acc

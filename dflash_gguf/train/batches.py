"""Training batches: cached sequences -> padded tensors of blocks, mask, labels and slot weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .data import FeatureCache, SequenceRecord
from .recipe import IGNORE, attention_mask, block_inputs, block_labels, label_positions, sample_anchors, slot_weights, valid_anchors


@dataclass
class Batch:
    features: torch.Tensor  # (S, C, n_feat*h) float32
    ctx_pos: torch.Tensor  # (S, C)
    block_ids: torch.Tensor  # (S, N*B)
    block_pos: torch.Tensor  # (S, N*B)
    mask: torch.Tensor  # (S, 1, N*B, C + N*B) bool
    labels: torch.Tensor  # (S, N*B) draft rows or IGNORE
    weights: torch.Tensor  # (S, N*B)
    prev: torch.Tensor | None = None  # (S, N*B) target id of the token before each slot's label
    truth: torch.Tensor | None = None  # (S, N*B) target id of each slot's label (IGNORE past the end)
    soft_ids: torch.Tensor | None = None  # (S, N*B, k) draft rows of the target's top-k, -1 if absent
    soft_logits: torch.Tensor | None = None  # (S, N*B, k)

    def to(self, device: torch.device) -> "Batch":
        return Batch(*(None if t is None else t.to(device) for t in (
            self.features, self.ctx_pos, self.block_ids, self.block_pos, self.mask, self.labels, self.weights,
            self.prev, self.truth, self.soft_ids, self.soft_logits)))

    @property
    def n_scored(self) -> int:
        return int((self.labels != IGNORE).sum())


def make_batch(
    cache: FeatureCache,
    records: list[SequenceRecord],
    anchors_per_record: list[np.ndarray],
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    t2d: np.ndarray | None,
    shift: int = 0,
    soft: bool = False,
) -> Batch:
    """Pack each record's blocks (at its given anchors) into one padded batch.

    The context of a sequence is cut after its last anchor, which is all any of its blocks sees.
    Records with fewer anchors get padding blocks at anchor 0 that see only themselves and are not scored.
    """
    n_blocks = max(1, max(len(a) for a in anchors_per_record))
    loaded = [cache.load(r) for r in records]
    ctx_lens = [int(a.max()) if len(a) else 1 for a in anchors_per_record]
    c_max = max(ctx_lens)
    width = loaded[0][1].shape[1]
    feats = np.zeros((len(records), c_max, width), dtype=np.float32)
    ids, pos, labels, masks, prevs, truths, s_ids, s_logits = [], [], [], [], [], [], [], []
    w_slot = slot_weights(block_size, gamma, shift)
    weights = []
    for i, ((tokens, f), anchors, c, r) in enumerate(zip(loaded, anchors_per_record, ctx_lens, records)):
        feats[i, :c] = f[:c]
        n_pad = n_blocks - len(anchors)
        a = np.concatenate([anchors, np.zeros(n_pad, dtype=np.int64)])
        bi, bp = block_inputs(tokens, a, block_size, mask_token_id)
        lab = block_labels(tokens, a, block_size, t2d, shift)
        truth = block_labels(tokens, a, block_size, None, shift)
        if n_pad:
            lab[len(anchors) * block_size :] = IGNORE
            truth[len(anchors) * block_size :] = IGNORE
        lpos = np.minimum(label_positions(a, block_size, shift).reshape(-1), len(tokens) - 1)
        prevs.append(tokens[lpos - 1])
        truths.append(truth)
        if soft:
            topk = cache.load_topk(r)
            k = cache.manifest.top_k or 1
            if topk is None:
                si, sl = np.full((len(lpos), k), -1, dtype=np.int64), np.zeros((len(lpos), k), dtype=np.float32)
            else:
                si, sl = topk[0][lpos - 1], topk[1][lpos - 1]  # row j predicts token j + 1
                if t2d is not None:
                    si = np.where(si >= 0, t2d[np.maximum(si, 0)], -1)
            si = np.where((lab == IGNORE)[:, None], -1, si)
            s_ids.append(si)
            s_logits.append(sl)
        ids.append(bi)
        pos.append(bp)
        labels.append(lab)
        weights.append(np.tile(w_slot, n_blocks))
        masks.append(attention_mask(c_max, c, a, block_size))
    return Batch(
        features=torch.from_numpy(feats),
        ctx_pos=torch.arange(c_max).expand(len(records), c_max).clone(),
        block_ids=torch.from_numpy(np.stack(ids)),
        block_pos=torch.from_numpy(np.stack(pos)),
        mask=torch.stack(masks)[:, None],
        labels=torch.from_numpy(np.stack(labels)),
        weights=torch.from_numpy(np.stack(weights)).float(),
        prev=torch.from_numpy(np.stack(prevs)),
        truth=torch.from_numpy(np.stack(truths)),
        soft_ids=torch.from_numpy(np.stack(s_ids)) if soft else None,
        soft_logits=torch.from_numpy(np.stack(s_logits)).float() if soft else None,
    )


def draw_anchors(record: SequenceRecord, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random anchors in the response of one cached sequence."""
    return sample_anchors(valid_anchors(record.n_tokens, record.n_features, record.response_start), n_blocks, rng)


def spread_anchors(record: SequenceRecord, n_blocks: int) -> np.ndarray:
    """Evenly spaced anchors over the response (deterministic, for evaluation)."""
    cand = valid_anchors(record.n_tokens, record.n_features, record.response_start)
    if len(cand) <= n_blocks:
        return cand
    return cand[np.linspace(0, len(cand) - 1, n_blocks).round().astype(np.int64)]

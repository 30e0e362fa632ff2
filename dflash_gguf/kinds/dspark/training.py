"""DSpark's torch part: the Markov and confidence heads, DeepSpec's loss, and its greedy chained draft."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..training import IGNORE, Loss, ScoredRows, Training


class MarkovHead(nn.Module):
    """DSpark's vanilla Markov head: a low-rank bias on the next token's logits from the previous
    token, `W2 W1[prev]`, chained through the block (DeepSpec `VanillaMarkov`)."""

    def __init__(self, n_vocab: int, n_draft: int, rank: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(n_vocab, rank)
        self.markov_w2 = nn.Linear(rank, n_draft, bias=False)

    def bias(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w2(self.markov_w1(prev))


class ConfidenceHead(nn.Module):
    """DSpark's confidence head: a logit of each slot's acceptance from [hidden ; W1[prev]]."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


def dspark_loss(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, confidence: torch.Tensor,
    target_probs: torch.Tensor, *, ce_weight: float, l1_weight: float, confidence_weight: float,
) -> tuple[torch.Tensor, dict]:
    """DSpark's loss as DeepSpec defines it, over scored rows (labels != IGNORE):

    ce_weight x CE(label) + l1_weight x ||q - p||_1 + confidence_weight x BCE(confidence, a), where
    q is the draft distribution, p the target's and a = 1 - ||q - p||_1 / 2 the probability that a
    draft from q is accepted by p at this slot alone (per slot, not the cumulative prefix product;
    detached: the confidence head learns the acceptance it observes, it does not shape the drafts).
    Every term is slot-weighted.

    DeepSpec's p is dense. `target_probs` may hold p only on some rows (the target's top-k), summing
    to less than 1: the rows where it is 0 are then lumped into one outcome, "another token", with
    mass 1 - sum(p) against q's mass there. That is exact when p is a full distribution (dense or
    one-hot) and otherwise the total variation over {each known token, the rest}, a lower bound.
    """
    scored = labels != IGNORE
    w = weights * scored
    den = w.sum().clamp_min(1e-9)
    safe = torch.where(scored, labels, torch.zeros_like(labels))
    ce = torch.nn.functional.cross_entropy(logits.float(), safe, reduction="none")
    q = torch.softmax(logits.float(), dim=-1)
    p = target_probs.float()
    known = p > 0
    tail = ((q * ~known).sum(-1) - (1.0 - p.sum(-1)).clamp_min(0.0)).abs()
    l1 = ((q - p).abs() * known).sum(-1) + tail
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(confidence.float(), accept, reduction="none")
    loss = (ce_weight * (ce * w).sum() + l1_weight * (l1 * w).sum() + confidence_weight * (bce * w).sum()) / den
    with torch.no_grad():
        stats = {"ce": float((ce * w).sum() / den), "l1": float((l1 * w).sum() / den),
                 "confidence_bce": float((bce * w).sum() / den), "accept": float((accept * w).sum() / den)}
    return loss, stats


class DSparkTraining(Training):
    """The Markov head biases each slot's logits by the token before it; the confidence head scores each
    slot's acceptance; the loss is DeepSpec's, against the target's distribution where the cache keeps it."""

    target_distribution = True  # the total-variation and confidence terms

    def hf_config(self, cfg: Any, config: dict[str, Any]) -> None:
        # the fields DeepSpec's config requires and upstream's DSparkModel converter reads
        config.update(
            markov_rank=cfg.markov_rank, markov_head_type="vanilla", enable_confidence_head=True,
            confidence_head_with_markov=True, sample_from_anchor=True, num_anchors=512,
            target_layer_ids=list(cfg.target_layer_ids), mask_token_id=cfg.mask_token_id,
        )

    def modules(self, cfg: Any, n_draft: int) -> dict[str, nn.Module]:
        return {"markov_head": MarkovHead(cfg.vocab_size, n_draft, cfg.markov_rank),
                "confidence_head": ConfidenceHead(cfg.hidden_size + cfg.markov_rank)}

    def step_logits(self, model: Any, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return model.logits(hidden) + model.markov_head.bias(prev)

    def confidence(self, model: Any, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return model.confidence_head(torch.cat([hidden, model.markov_head.markov_w1(prev)], dim=-1))

    def draft(self, model: Any, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Argmax of each slot with the Markov bias of the previous pick."""
        prev, picks = anchor, []
        for j in range(hidden.shape[1]):
            row = self.step_logits(model, hidden[:, j], prev).argmax(-1)
            picks.append(row)
            prev = row if model.d2t is None else model.d2t[row]
        return torch.stack(picks, dim=1)

    def loss(self, model: Any, rows: ScoredRows, cfg: Any, distill: Callable[[], Loss]) -> Loss:
        logits, labels, soft_ids, soft_logits = rows.logits, rows.labels, rows.soft_ids, rows.soft_logits
        conf = self.confidence(model, rows.hidden, rows.prev)
        p = torch.zeros_like(logits, dtype=torch.float32)
        if soft_ids is not None:
            # the target's own probabilities of its kept top-k (not renormalised): the mass they
            # leave out is the tail dspark_loss lumps, as close to DeepSpec's dense p as the cache allows
            kept = torch.where(soft_ids >= 0, soft_logits.float().exp(), torch.zeros_like(soft_logits.float()))
            p.scatter_add_(-1, soft_ids.clamp_min(0), kept)
        missing = p.sum(-1) <= 0  # no target distribution for this row: the label, one-hot
        p[missing] = torch.nn.functional.one_hot(labels[missing], p.shape[-1]).float()
        loss, _ = dspark_loss(
            logits, labels, rows.weights, conf, p,
            ce_weight=cfg.ce_weight if cfg.ce_weight is not None else 0.1, l1_weight=cfg.l1_weight,
            confidence_weight=cfg.confidence_weight,
        )
        acc = ((logits.argmax(-1) == labels).float().mean())
        return loss, acc

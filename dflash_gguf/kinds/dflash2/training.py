"""DFlash2's torch part: the grouped dynamic block convolutions, the candidate selector, and its loss."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..training import IGNORE, Loss, ScoredRows, Training


class BlockConv(nn.Module):
    """DFlash 2's grouped dynamic causal convolution, wrapped around one sublayer.

    Along the slots of each block (never across blocks), tap `o` mixes the value `o` slots back
    with a static per-channel weight `base_kernel[i, o]` plus a dynamic per-group weight that a
    linear map reads off the sublayer's (normed) input. `prepare` convolves the sublayer input
    (i = 0) and returns the dynamic weights for `finish`, which convolves its output (i = 1).
    The static taps start as the identity, so a fresh DFlash 2 layer is a DFlash layer.
    """

    def __init__(self, hidden: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.groups = hidden // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden))
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """x (b, n, h) in blocks of `block_size`; dynamic (b, n, taps, groups); base (taps, h)."""
        b, n, h = x.shape
        B, G = self.block_size, self.groups
        xb = x.reshape(b, n // B, B, G, self.group_size)
        dyn = dynamic.reshape(b, n // B, B, self.kernel_size, G, 1)
        out = torch.zeros_like(xb)
        for o in range(self.kernel_size):
            shifted = xb if o == 0 else F.pad(xb[:, :, : B - o], (0, 0, 0, 0, o, 0))
            w = base[o].reshape(G, self.group_size).to(x.dtype) + dyn[:, :, :, o]
            out = out + w * shifted
        return out.reshape(b, n, h)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dyn = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dyn[..., 0, :, :], self.base_kernel[0]), dyn[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1])


class CandidateSelector(nn.Module):
    """DFlash 2's low-rank path selector over the top-k candidates of each slot.

    A candidate `c` after predecessor `p` scores `logit[c] + <P[p] * W h, S[c]>`; a draft is the
    greedy chain of picks from the block's anchor token on.
    """

    def __init__(self, cfg: Any):
        super().__init__()
        self.top_k = cfg.selector_top_k
        self.predecessor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.successor_codebook = nn.Embedding(cfg.vocab_size, cfg.selector_rank)
        self.hidden_projection = nn.Linear(cfg.hidden_size, cfg.selector_rank, bias=False)

    def pair_scores(self, hidden: torch.Tensor, logits: torch.Tensor, predecessor: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """(..., k) scores of `candidates` (..., k) given `predecessor` (...) at slots `hidden` (..., h)."""
        unary = logits.gather(-1, candidates)
        q = self.predecessor_codebook(predecessor) * self.hidden_projection(hidden)
        return unary + (q.unsqueeze(-2) * self.successor_codebook(candidates)).sum(-1)

    def greedy_path(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """(n_blocks, m) picks for drafted slots hidden (n_blocks, m, h), logits (n_blocks, m, V), anchor (n_blocks,)."""
        candidates = logits.topk(self.top_k, dim=-1).indices
        prev, path = anchor, []
        for j in range(hidden.shape[1]):
            scores = self.pair_scores(hidden[:, j], logits[:, j], prev, candidates[:, j])
            prev = candidates[:, j].gather(-1, scores.argmax(-1, keepdim=True))[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1)


def selector_loss(scores: torch.Tensor, candidates: torch.Tensor, truth: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """DFlash 2 path-selector loss: slot-weighted cross-entropy over the k candidate scores (N, k)
    for the candidate that is the true token (N,); rows whose truth is not a candidate are skipped."""
    hit = candidates == truth[:, None]
    ok = hit.any(-1) & (truth != IGNORE)
    if not ok.any():
        return scores.sum() * 0.0
    ce = torch.nn.functional.cross_entropy(scores[ok].float(), hit[ok].float().argmax(-1), reduction="none")
    w = weights[ok]
    return (ce * w).sum() / w.sum().clamp_min(1e-9)


class DFlash2Training(Training):
    """Convolutions around each layer's attention and MLP, the selector over the whole drafter; the greedy
    draft is the selector's path, and the loss adds the selector's cross-entropy to the recipe's."""

    def hf_config(self, cfg: Any, config: dict[str, Any]) -> None:
        config["dflash_config"].update(
            conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
            selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k,
        )

    def layer_convs(self, cfg: Any) -> tuple[nn.Module | None, nn.Module | None]:
        args = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
        return BlockConv(*args), BlockConv(*args)

    def modules(self, cfg: Any, n_draft: int) -> dict[str, nn.Module]:
        return {"candidate_selector": CandidateSelector(cfg)}

    def draft(self, model: Any, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return model.candidate_selector.greedy_path(hidden, model.logits(hidden), anchor)

    def loss(self, model: Any, rows: ScoredRows, cfg: Any, distill: Callable[[], Loss]) -> Loss:
        loss, acc = distill()
        sel = model.candidate_selector
        candidates = rows.logits.detach().topk(sel.top_k, dim=-1).indices
        scores = sel.pair_scores(rows.hidden, rows.logits, rows.prev, candidates)
        return loss + cfg.selector_weight * selector_loss(scores, candidates, rows.truth, rows.weights), acc

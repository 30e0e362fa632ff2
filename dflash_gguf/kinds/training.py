"""What a drafter kind adds to training a drafter (dflash-train), in torch; the base kind (DFlash) adds nothing.

Only the trainer imports this (through `DrafterKind.training()`), so the runtime never loads torch. The hooks
get the trainer's own objects (its torch `Drafter` as `model`, its `DrafterConfig` / `TrainConfig` as `cfg`)
and read only their documented fields; the recipe's distillation loss is handed in, so a kind's loss can
build on it without importing the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

IGNORE = -100
"""Label of a slot that is not scored (slot 0, beyond the sequence, or outside the draft vocab)."""


@dataclass
class ScoredRows:
    """One batch's scored slots: hidden states, previous tokens, labels and what the cache adds."""

    hidden: torch.Tensor  # (N, h)
    prev: torch.Tensor  # (N,) target id of the token before each slot
    logits: torch.Tensor  # (N, V) the model's step logits
    labels: torch.Tensor  # (N,) draft rows
    weights: torch.Tensor  # (N,) slot weights
    truth: torch.Tensor  # (N,) target ids of the labels
    soft_ids: torch.Tensor | None  # (N, k) the target's top-k (draft rows, -1 outside), where the cache has them
    soft_logits: torch.Tensor | None  # (N, k)


Loss = tuple[torch.Tensor, torch.Tensor]
"""(loss, slot accuracy)."""


class Training:
    """The hooks; a kind that trains differently subclasses it."""

    target_distribution = False  # its loss reads the target's distribution (the cache's top-k) wherever it is kept

    def hf_config(self, cfg: Any, config: dict[str, Any]) -> None:
        """Add this kind's keys to the checkpoint's config.json (`DrafterConfig.to_hf`)."""

    def layer_convs(self, cfg: Any) -> tuple[nn.Module | None, nn.Module | None]:
        """The modules wrapped around each layer's attention and MLP, or None."""
        return None, None

    def modules(self, cfg: Any, n_draft: int) -> dict[str, nn.Module]:
        """Modules of the whole drafter only this kind has, by attribute (and checkpoint) name."""
        return {}

    def step_logits(self, model: Any, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits of slots whose previous token (target id) is `prev`."""
        return model.logits(hidden)

    def confidence(self, model: Any, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Acceptance logit of each slot, for a kind with a confidence head."""
        raise TypeError(f"a {model.cfg.kind} drafter has no confidence head")

    def draft(self, model: Any, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Greedy draft of each block as the runtime makes it: (n_blocks, m) draft rows from the hidden states
        of the predicting slots (n_blocks, m, h) and the anchor tokens (n_blocks,)."""
        return model.logits(hidden).argmax(-1)

    def loss(self, model: Any, rows: ScoredRows, cfg: Any, distill: Callable[[], Loss]) -> Loss:
        """The training loss over the scored rows; `distill()` is the recipe's (hard and soft labels)."""
        return distill()

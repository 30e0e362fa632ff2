"""DFlash (z-lab's `DFlashDraftModel`): the base kind. Every drafter GGUF without another kind's marker is one.

Its parts are the defaults: the head reads each slot's logits (`kinds.head.LogitsHead`), the converter and
the trainer add nothing (`kinds.converting.Converter`, `kinds.training.Training`).
"""

from __future__ import annotations

from ..base import DrafterKind

KIND = DrafterKind(name="dflash", label="DFlash", architectures=("DFlashDraftModel",))

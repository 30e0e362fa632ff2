"""Converting a DFlash2 checkpoint: its convolution and selector tensors, and the four keys libllama reads."""

from __future__ import annotations

from typing import Any

import gguf

from ...schema import Keys, Tensors
from ..converting import Converter, Shape, draft_value

V = gguf.GGUFValueType
_KEYS = (
    (Keys.CONV_KERNEL_SIZE, "conv_kernel_size"),
    (Keys.CONV_GROUP_SIZE, "conv_group_size"),
    (Keys.SELECTOR_RANK, "selector_rank"),
    (Keys.SELECTOR_TOP_K, "selector_top_k"),
)


class DFlash2Converter(Converter):
    def shapes(self, cfg: Any) -> tuple[dict[str, Shape], dict[str, Shape]]:
        h = cfg.hidden_size
        kernel = int(draft_value(cfg.hparams, "conv_kernel_size"))
        groups = h // int(draft_value(cfg.hparams, "conv_group_size"))
        rank = int(draft_value(cfg.hparams, "selector_rank"))
        per_layer = {
            Tensors.ATTN_CONV_BASE: (2, kernel, h),
            Tensors.ATTN_CONV_PROJ: (2 * kernel * groups, h),
            Tensors.FFN_CONV_BASE: (2, kernel, h),
            Tensors.FFN_CONV_PROJ: (2 * kernel * groups, h),
        }
        whole = {
            Tensors.SELECTOR_PREV: (cfg.vocab_size, rank),
            Tensors.SELECTOR_NEXT: (cfg.vocab_size, rank),
            Tensors.SELECTOR_HIDDEN: (rank, h),
        }
        return whole, per_layer

    def metadata(self, cfg: Any, tensor_names: set[str]) -> list[tuple[str, Any, gguf.GGUFValueType]]:
        return [(key, int(draft_value(cfg.hparams, name)), V.UINT32) for key, name in _KEYS]

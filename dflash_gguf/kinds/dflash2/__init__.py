"""DFlash2 (z-lab's `DFlash2DraftModel`): DFlash layers wrapped in grouped dynamic block convolutions, and a
low-rank path selector over each slot's top-k candidates.

libllama builds it where `selector_hidden.weight` is present and outputs the selector's lattice through the
nextn rows (`head.LatticeHead` walks it); `convert` writes its keys and checks its tensors; `training` holds
its torch modules and the selector's loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import gguf

from ...schema import Keys, Tensors
from ..base import ConfigKey, DrafterKind, Hparams, MetaKey, TensorSpec
from .convert import DFlash2Converter
from .head import LatticeHead

if TYPE_CHECKING:
    from ..training import Training

V = gguf.GGUFValueType
_U32 = (V.UINT32,)


def _training() -> Training:
    """Its torch part, imported when the trainer asks for it."""
    from .training import DFlash2Training

    return DFlash2Training()


def _conv_groups(h: Hparams) -> int:
    return h.n_embd // max(1, int(h.get("conv_group_size", 1)))


def _gguf_dflash2(h: Hparams) -> str | None:
    group, top_k = int(h.get("conv_group_size")), int(h.get("selector_top_k"))
    if h.n_embd % group:
        return f"embedding_length {h.n_embd} is not divisible by conv_group_size {group}"
    if h.n_embd < top_k * (top_k + 1):
        return f"embedding_length {h.n_embd} is too small for selector_top_k {top_k}"
    if h.n_vocab is not None and top_k > h.n_vocab:
        return f"selector_top_k {top_k} exceeds the vocabulary of {h.n_vocab} (ggml_top_k asserts)"
    return None


def _config_dflash2(v: dict[str, Any]) -> str | None:
    hidden = v["hidden_size"]
    if hidden % v["conv_group_size"]:
        return f"hidden_size {hidden} is not divisible by conv_group_size {v['conv_group_size']}"
    top_k = v["selector_top_k"]
    if hidden < top_k * (top_k + 1):
        return f"hidden_size {hidden} is too small for selector_top_k {top_k}"
    if top_k > v["vocab_size"]:
        return f"selector_top_k {top_k} exceeds vocab_size {v['vocab_size']}"
    return None



KIND = DrafterKind(
    name="dflash2",
    label="DFlash2",
    architectures=("DFlash2DraftModel",),
    marker=Tensors.SELECTOR_HIDDEN,  # load_arch_tensors: selector_meta
    gguf_keys=(
        MetaKey(Keys.CONV_KERNEL_SIZE, _U32, required=True, min=1, max=256),
        MetaKey(Keys.CONV_GROUP_SIZE, _U32, required=True, min=1, max=2**20),
        MetaKey(Keys.SELECTOR_RANK, _U32, required=True, min=1, max=2**16),
        MetaKey(Keys.SELECTOR_TOP_K, _U32, required=True, min=1, max=1024),
    ),
    gguf_tensors=(
        TensorSpec(Tensors.ATTN_CONV_BASE, lambda h: (h.n_embd, int(h.get("conv_kernel_size")), 2), storage="f32"),
        TensorSpec(Tensors.ATTN_CONV_PROJ, lambda h: (h.n_embd, 2 * int(h.get("conv_kernel_size")) * _conv_groups(h))),
        TensorSpec(Tensors.FFN_CONV_BASE, lambda h: (h.n_embd, int(h.get("conv_kernel_size")), 2), storage="f32"),
        TensorSpec(Tensors.FFN_CONV_PROJ, lambda h: (h.n_embd, 2 * int(h.get("conv_kernel_size")) * _conv_groups(h))),
        TensorSpec(Tensors.SELECTOR_PREV, lambda h: (int(h.get("selector_rank")), h.n_vocab)),
        TensorSpec(Tensors.SELECTOR_NEXT, lambda h: (int(h.get("selector_rank")), h.n_vocab)),
        TensorSpec(Tensors.SELECTOR_HIDDEN, lambda h: (h.n_embd, int(h.get("selector_rank")))),
    ),
    gguf_rules=(_gguf_dflash2,),
    config_keys=(
        ConfigKey("conv_kernel_size", "int", where="draft", min=1, max=256, required=True),
        ConfigKey("conv_group_size", "int", where="draft", min=1, max=2**20, required=True),
        ConfigKey("selector_rank", "int", where="draft", min=1, max=2**16, required=True),
        ConfigKey("selector_top_k", "int", where="draft", min=1, max=1024, required=True),
    ),
    config_rules=(_config_dflash2,),
    reduced_vocab=False,  # its selector spans the full vocabulary
    head=LatticeHead,
    converter=DFlash2Converter(),
    training=_training,
)

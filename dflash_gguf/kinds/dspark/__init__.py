"""DSpark (DeepSpec's drafters, and the vllm speculators export): DFlash layers with a vanilla Markov head
biasing each slot's logits by the token before it, an optional confidence head, and an anchor-first block.

libllama builds it where `markov_w1.weight` is present; `head.DSparkHead` re-conditions a sampled draft on
the tokens really drawn; `convert` brings its config schemas to DFlash's; `training` holds its heads and
DeepSpec's loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import gguf

from ...schema import MARKOV_HEAD_TYPES, Keys, Tensors
from ..base import MAX_BLOCK_SIZE, MAX_LAYERS, ConfigKey, DrafterKind, Hparams, MetaKey, TensorSpec
from .convert import DSparkConverter
from .head import DSparkHead

if TYPE_CHECKING:
    from ..training import Training

V = gguf.GGUFValueType
_U32 = (V.UINT32,)


def _training() -> Training:
    """Its torch part, imported when the trainer asks for it."""
    from .training import DSparkTraining

    return DSparkTraining()


def _gguf_markov_head(h: Hparams) -> str | None:
    """The Markov head's rank is markov_w1's ne0; markov_w2 and conf_proj must agree (create_tensor would throw
    on a mismatch, but a wrong row count of a matrix read by get_rows / mul_mat is what asserts)."""
    rank = h.shapes[Tensors.MARKOV_W1][0]
    w2 = h.shapes[Tensors.MARKOV_W2]
    if w2[0] != rank:
        return f"{Tensors.MARKOV_W2}: tensor shape {list(w2)}, markov_w1 has rank {rank}"
    conf = h.shapes.get(Tensors.CONF_PROJ)
    if conf is not None and conf[0] != h.n_embd + rank:
        return f"{Tensors.CONF_PROJ}: tensor shape {list(conf)}, expected [{h.n_embd + rank}, 1] (hidden + markov rank)"
    if Tensors.CONF_PROJ_BIAS in h.shapes and conf is None:
        return f"{Tensors.CONF_PROJ_BIAS}: a confidence bias without conf_proj.weight"
    return None


def _config_markov(v: dict[str, Any]) -> str | None:
    if v.get("markov_rank") == 0:
        return "markov_rank 0 (no Markov head) is not a DSpark drafter libllama can run; convert it as DFlash"
    return None



KIND = DrafterKind(
    name="dspark",
    label="DSpark",
    architectures=(
        "DSparkDraftModel",
        "Qwen3DSparkModel",
        "DSparkSpeculator",  # vllm speculators export: nested transformer_layer_config, bonus-anchor block
        "Lfm2DSparkDraftModel",
        "LingDSparkModel",
    ),
    marker=Tensors.MARKOV_W1,  # load_arch_tensors: markov_meta
    anchor_key=Keys.SAMPLE_FROM_ANCHOR,
    gguf_keys=(
        # the Markov head reads block_size with std::stoi and asserts it (GGML_ASSERT)
        MetaKey(Keys.BLOCK_SIZE, _U32, required=True, min=1, max=MAX_BLOCK_SIZE),
        MetaKey(Keys.SAMPLE_FROM_ANCHOR, (V.BOOL,)),
    ),
    # load_arch_tensors (markov_meta): {rank, n_vocab}, {rank, n_vocab_draft}, conf {n_embd + rank, 1};
    # the rank is markov_w1's, related across them by _gguf_markov_head
    gguf_tensors=(
        TensorSpec(Tensors.MARKOV_W1, lambda h: (None, h.n_vocab)),
        TensorSpec(Tensors.MARKOV_W2, lambda h: (None, h.n_draft)),
        TensorSpec(Tensors.CONF_PROJ, lambda h: (None, 1), required=False),
        TensorSpec(Tensors.CONF_PROJ_BIAS, lambda h: (1,), required=False, storage="f32"),
    ),
    gguf_tensor_rules=(_gguf_markov_head,),
    config_keys=(
        ConfigKey("transformer_layer_config", "object", note="speculators export: the nested transformer"),
        ConfigKey("aux_hidden_state_layer_ids", "int_list", min=1, max=MAX_LAYERS + 1, note="HF ids + 1"),
        ConfigKey("sample_from_anchor", "bool"),
        ConfigKey("markov_head_type", "str", where="draft", choices=MARKOV_HEAD_TYPES, default="vanilla",
                  note="libllama's build_dspark_markov_head computes the vanilla head only"),
        ConfigKey("markov_rank", "int", where="draft", min=0, max=2**16),
    ),
    config_rules=(_config_markov,),
    full_vocab_head=False,
    label_shift=1,  # DeepSpec: slot k predicts the token after its position, slot 0 included
    head=DSparkHead,
    converter=DSparkConverter(),
    training=_training,
)

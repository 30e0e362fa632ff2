"""The `dflash` GGUF schema: the one place where its names are spelled.

Everything that reads or writes a drafter GGUF imports these names, as gguf-py's
`constants.py` is imported by its writers. Each value matches what the llama.cpp
bundled with llama-cpp-python 0.3.36 reads (`src/models/dflash.cpp`,
`src/llama-arch.cpp`) and what its converter writes (`conversion/qwen.py`).
"""

from __future__ import annotations

import re

ARCH = "dflash"
"""`general.architecture` of a drafter GGUF."""

DEFAULT_BLOCK_SIZE = 16
"""Block size llama.cpp assumes when `dflash.block_size` is absent."""


def _arch_key(suffix: str) -> str:
    return f"{ARCH}.{suffix}"


class Keys:
    """Metadata keys. Model keys carry the architecture prefix, as llama.cpp expects."""

    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    FILE_TYPE = "general.file_type"
    QUANTIZATION_VERSION = "general.quantization_version"

    # transformer geometry (llama.cpp's generic `{arch}.*` keys)
    CONTEXT_LENGTH = _arch_key("context_length")
    EMBEDDING_LENGTH = _arch_key("embedding_length")
    FEED_FORWARD_LENGTH = _arch_key("feed_forward_length")
    BLOCK_COUNT = _arch_key("block_count")
    HEAD_COUNT = _arch_key("attention.head_count")
    HEAD_COUNT_KV = _arch_key("attention.head_count_kv")
    KEY_LENGTH = _arch_key("attention.key_length")
    VALUE_LENGTH = _arch_key("attention.value_length")
    RMS_EPS = _arch_key("attention.layer_norm_rms_epsilon")
    CAUSAL = _arch_key("attention.causal")
    SLIDING_WINDOW = _arch_key("attention.sliding_window")
    SLIDING_WINDOW_PATTERN = _arch_key("attention.sliding_window_pattern")
    VALUE_SCALE = _arch_key("attention.value_scale")
    ROPE_FREQ_BASE = _arch_key("rope.freq_base")
    ROPE_DIMENSION_COUNT = _arch_key("rope.dimension_count")
    ROPE_DIMENSION_SECTIONS = _arch_key("rope.dimension_sections")  # M-RoPE targets
    HIDDEN_ACT = _arch_key("hidden_activation")
    VOCAB_SIZE = _arch_key("vocab_size")  # read only when tokenizer.ggml.model is "none"

    # optional output/input transforms (z-lab `dflash_config` scale keys)
    EMBEDDING_SCALE = _arch_key("embedding_scale")  # input_embedding_scale
    LOGIT_SCALE = _arch_key("logit_scale")  # output_multiplier
    FINAL_LOGIT_SOFTCAPPING = _arch_key("final_logit_softcapping")

    # DFlash proper
    TARGET_LAYERS = _arch_key("target_layers")  # HF target_layer_ids + 1
    BLOCK_SIZE = _arch_key("block_size")
    # DFlash2
    CONV_KERNEL_SIZE = _arch_key("conv_kernel_size")
    CONV_GROUP_SIZE = _arch_key("conv_group_size")
    SELECTOR_RANK = _arch_key("selector_rank")
    SELECTOR_TOP_K = _arch_key("selector_top_k")
    # DSpark: the Markov head's block layout and whether a confidence head is present
    SAMPLE_FROM_ANCHOR = _arch_key("sample_from_anchor")  # true: anchor-first (slot 0 predicts); false: bonus anchor
    HAS_CONFIDENCE_HEAD = _arch_key("has_confidence_head")

    # tokenizer
    MASK_TOKEN_ID = "tokenizer.ggml.mask_token_id"
    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PREFIX = "tokenizer."

    # dflash-gguf's own keys: which target this drafter was made for
    TARGET_FINGERPRINT = "dflash_gguf.target.fingerprint"
    TARGET_ARCH = "dflash_gguf.target.architecture"
    TARGET_N_EMBD = "dflash_gguf.target.embedding_length"
    TARGET_N_LAYER = "dflash_gguf.target.block_count"
    TARGET_N_VOCAB = "dflash_gguf.target.vocab_size"
    CONVERTER_VERSION = "dflash_gguf.converter_version"


class Tensors:
    """GGUF tensor names. `{bid}` is the drafter layer index."""

    FC = "fc.weight"
    HIDDEN_NORM = "enc.output_norm.weight"  # hidden_norm, after fc
    OUTPUT_NORM = "output_norm.weight"  # norm, before the shared LM head
    D2T = "d2t"  # reduced draft vocabulary: draft row -> target token id
    OUTPUT = "output.weight"  # own LM head (reduced-vocab drafters)
    TOKEN_EMBD = "token_embd.weight"

    ATTN_NORM = "blk.{bid}.attn_norm.weight"
    ATTN_Q = "blk.{bid}.attn_q.weight"
    ATTN_K = "blk.{bid}.attn_k.weight"
    ATTN_V = "blk.{bid}.attn_v.weight"
    ATTN_OUT = "blk.{bid}.attn_output.weight"
    ATTN_Q_NORM = "blk.{bid}.attn_q_norm.weight"
    ATTN_K_NORM = "blk.{bid}.attn_k_norm.weight"
    FFN_NORM = "blk.{bid}.ffn_norm.weight"
    FFN_GATE = "blk.{bid}.ffn_gate.weight"
    FFN_UP = "blk.{bid}.ffn_up.weight"
    FFN_DOWN = "blk.{bid}.ffn_down.weight"

    # DFlash2: grouped dynamic convolutions and the candidate selector
    ATTN_CONV_BASE = "blk.{bid}.attn_conv_base"  # no `.weight` suffix upstream
    ATTN_CONV_PROJ = "blk.{bid}.attn_conv_proj.weight"
    FFN_CONV_BASE = "blk.{bid}.ffn_conv_base"
    FFN_CONV_PROJ = "blk.{bid}.ffn_conv_proj.weight"
    SELECTOR_PREV = "selector_predecessor.weight"
    SELECTOR_NEXT = "selector_successor.weight"
    SELECTOR_HIDDEN = "selector_hidden.weight"

    # DSpark: low-rank Markov head (bias = W2 @ W1[prev token]) and the optional confidence head
    MARKOV_W1 = "markov_w1.weight"  # HF (n_vocab, rank): an embedding of the previous token
    MARKOV_W2 = "markov_w2.weight"  # HF (n_vocab_draft, rank)
    CONF_PROJ = "conf_proj.weight"  # HF (1, n_embd + rank): over [hidden; W1[prev]]
    CONF_PROJ_BIAS = "conf_proj.bias"  # HF (1,)
    ATTN_SINKS = "blk.{bid}.attn_sinks.weight"  # per-head attention sinks (HF self_attn.sinks)


# HF (z-lab checkpoint) name -> GGUF name. `{bid}` is the layer index.
HF_TO_GGUF: dict[str, str] = {
    "fc.weight": Tensors.FC,
    "hidden_norm.weight": Tensors.HIDDEN_NORM,
    "norm.weight": Tensors.OUTPUT_NORM,
    "d2t": Tensors.D2T,
    "lm_head.weight": Tensors.OUTPUT,
    "embed_tokens.weight": Tensors.TOKEN_EMBD,
    "layers.{bid}.input_layernorm.weight": Tensors.ATTN_NORM,
    "layers.{bid}.self_attn.q_proj.weight": Tensors.ATTN_Q,
    "layers.{bid}.self_attn.k_proj.weight": Tensors.ATTN_K,
    "layers.{bid}.self_attn.v_proj.weight": Tensors.ATTN_V,
    "layers.{bid}.self_attn.o_proj.weight": Tensors.ATTN_OUT,
    "layers.{bid}.self_attn.q_norm.weight": Tensors.ATTN_Q_NORM,
    "layers.{bid}.self_attn.k_norm.weight": Tensors.ATTN_K_NORM,
    "layers.{bid}.post_attention_layernorm.weight": Tensors.FFN_NORM,
    "layers.{bid}.mlp.gate_proj.weight": Tensors.FFN_GATE,
    "layers.{bid}.mlp.up_proj.weight": Tensors.FFN_UP,
    "layers.{bid}.mlp.down_proj.weight": Tensors.FFN_DOWN,
    "layers.{bid}.attention_conv.base_kernel": Tensors.ATTN_CONV_BASE,
    "layers.{bid}.attention_conv.kernel_projection.weight": Tensors.ATTN_CONV_PROJ,
    "layers.{bid}.mlp_conv.base_kernel": Tensors.FFN_CONV_BASE,
    "layers.{bid}.mlp_conv.kernel_projection.weight": Tensors.FFN_CONV_PROJ,
    "candidate_selector.predecessor_codebook.weight": Tensors.SELECTOR_PREV,
    "candidate_selector.predecessor_codebook": Tensors.SELECTOR_PREV,
    "candidate_selector.successor_codebook.weight": Tensors.SELECTOR_NEXT,
    "candidate_selector.successor_codebook": Tensors.SELECTOR_NEXT,
    "candidate_selector.hidden_projection.weight": Tensors.SELECTOR_HIDDEN,
    "markov_head.markov_w1.weight": Tensors.MARKOV_W1,
    "markov_head.markov_w2.weight": Tensors.MARKOV_W2,
    "confidence_head.proj.weight": Tensors.CONF_PROJ,
    "confidence_head.proj.bias": Tensors.CONF_PROJ_BIAS,
    "layers.{bid}.self_attn.sinks": Tensors.ATTN_SINKS,
    "layers.{bid}.self_attn.sinks.weight": Tensors.ATTN_SINKS,
}

MARKOV_HEAD_TYPES = ("vanilla",)
"""What libllama's build_dspark_markov_head computes: bias = W2 @ W1[prev]; gated / rnn heads are not."""

# HF tensors that are never written: rotary caches, and `t2d` (unused at runtime).
HF_IGNORED = re.compile(r"(^|\.)(rotary_emb\.inv_freq|t2d)$")

_HF_PATTERNS = [
    (re.compile("^" + re.escape(hf).replace(r"\{bid\}", r"(?P<bid>\d+)") + "$"), gguf)
    for hf, gguf in HF_TO_GGUF.items()
]


def gguf_tensor_name(hf_name: str) -> str | None:
    """The GGUF name for an HF checkpoint tensor, or None if the schema does not know it.

    A leading `model.` (as in transformers exports) is accepted and dropped.
    """
    name = hf_name.removeprefix("model.")
    for pattern, gguf in _HF_PATTERNS:
        m = pattern.match(name)
        if m:
            return gguf.format(bid=m.group("bid")) if "bid" in pattern.groupindex else gguf
    return None


def hf_layer_to_gguf(target_layer_ids: list[int]) -> list[int]:
    """HF `target_layer_ids` (layer outputs) -> `dflash.target_layers` (layer inputs): +1."""
    return [int(i) + 1 for i in target_layer_ids]


def gguf_layer_to_hf(target_layers: list[int]) -> list[int]:
    """Inverse of `hf_layer_to_gguf`."""
    return [int(i) - 1 for i in target_layers]

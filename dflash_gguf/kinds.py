"""Drafter kinds (DFlash, DFlash2, DSpark): what differs between them, said once.

A kind is one `DrafterKind` in the registry: its name, the config.json architectures that convert as it,
the GGUF tensor whose presence makes a drafter that kind (as libllama's `load_arch_tensors` decides,
src/models/dflash.cpp), its block layout, and the rows it adds to the checks of a drafter GGUF
(`drafter_gguf`) and of a checkpoint's config.json (`convert.config_schema`). Readers never decide a kind
themselves: a GGUF's kind is `kind_of_tensors`, a checkpoint's `kind_of_architecture`, a name's
`kind_named`. Adding a kind is registering one (`register`); the tables pick up its rows.

The row types (`MetaKey`, `TensorSpec`, `Hparams` for the GGUF, `ConfigKey` for config.json) live here so
that a kind can carry its own rows without importing the modules that check them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import gguf

from .schema import ARCH, MARKOV_HEAD_TYPES, Keys, Tensors

V = gguf.GGUFValueType

MAX_BLOCK_SIZE = 1024
"""A drafted block is one libllama batch; published drafters use 8 to 16."""
MAX_LAYERS = 512
"""LLAMA_MAX_LAYERS (src/llama-hparams.h): libllama asserts block counts above it."""


class KindError(ValueError):
    """A drafter whose kind cannot be decided, or a kind that cannot be registered."""


# ---------------------------------------------------------------------------------------------------------------
# row types


@dataclass(frozen=True)
class MetaKey:
    """One GGUF metadata key: its GGUF type(s), range and presence."""

    key: str  # full key, `{arch}` for the architecture prefix
    types: tuple[V, ...]  # accepted scalar types; V.ARRAY accepts an array of `array_of`
    array_of: tuple[V, ...] = ()
    required: bool = False
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    finite: bool = True  # floats: NaN / inf refused
    choices: tuple[str, ...] | None = None
    per_layer: bool = False  # an array must have block_count entries (get_key_or_arr)
    note: str = ""


@dataclass
class Hparams:
    """The values a drafter GGUF's tensor shapes and rules are computed from (libllama's defaults applied)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_k: int
    head_v: int
    n_ff: int
    n_rot: int
    n_vocab: int | None  # None when neither the GGUF nor a target says it
    n_draft: int | None  # rows of the drafter's own head: d2t's length with a reduced vocabulary, else n_vocab
    n_targets: int
    values: dict[str, Any] = field(default_factory=dict)  # key (arch prefix resolved) -> value
    counts: dict[str, int] = field(default_factory=dict)  # array key -> its length (long string arrays keep only this)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tensor name -> ggml shape (ne0 first)

    def get(self, suffix: str, default: Any = None) -> Any:
        return self.values.get(f"{ARCH}.{suffix}", default)


@dataclass(frozen=True)
class TensorSpec:
    """One GGUF tensor: its name, its shape in ggml order (ne0 first) from the hparams, its storage types.

    A dimension given as None is not checked against the hparams (a kind's rule relates it to others)."""

    name: str  # `{bid}` for per-layer tensors
    shape: Callable[[Hparams], tuple[int | None, ...]]
    required: bool = True
    storage: str = "matrix"  # "f32": F32 only (norms, conv bases); "matrix": any ggml type; "i64": I64 only


@dataclass(frozen=True)
class ConfigKey:
    """One config.json key: where it is read, what it must be, and its default when absent
    (`convert.config_schema` says what `where` and `type` take)."""

    name: str
    type: str  # "int" | "float" | "bool" | "str" | "int_list" | "str_list" | "object"
    where: str = "top"
    min: float | None = None
    max: float | None = None
    min_exclusive: bool = False
    choices: tuple[Any, ...] | None = None
    required: bool = False
    default: Any = None
    note: str = ""


GGUFRule = Callable[[Hparams], str | None]
"""A check relating a drafter GGUF's values: the problem, or None."""
ConfigRule = Callable[[dict[str, Any]], str | None]
"""A check relating config.json values (name -> value, defaults filled): the problem, or None."""


# ---------------------------------------------------------------------------------------------------------------
# the kind


@dataclass(frozen=True, eq=False)
class DrafterKind:
    """Everything that differs per drafter kind, for the converter, the GGUF checks, the runtime and the trainer.

    Compared by identity: there is one object per registered kind.
    """

    name: str  # "dflash2": Drafter.kind, the Steps' source name, dflash-train --kind, DrafterInfo.kind
    label: str  # "DFlash2": how people read it (--info, the TUI)
    architectures: tuple[str, ...] = ()  # config.json `architectures` that convert as this kind; [0] is dflash-train's
    marker: str | None = None  # the GGUF tensor that makes a drafter this kind; None: the base kind (no marker)
    anchor_key: str | None = None  # bool GGUF key: slot 0 predicts (absent: true); None: slot 0 holds the last token
    gguf_keys: tuple[MetaKey, ...] = ()  # metadata only this kind reads
    gguf_tensors: tuple[TensorSpec, ...] = ()  # tensors only this kind has
    gguf_rules: tuple[GGUFRule, ...] = ()  # checks relating its values, before the tensor table is checked
    gguf_tensor_rules: tuple[GGUFRule, ...] = ()  # checks relating its tensors' shapes, after the tensor table
    config_keys: tuple[ConfigKey, ...] = ()  # config.json keys only this kind reads
    config_rules: tuple[ConfigRule, ...] = ()
    reduced_vocab: bool = True  # may have a draft vocabulary smaller than the target's (d2t + its own head)
    full_vocab_head: bool = True  # a full-vocabulary head is written into the GGUF (DSpark's upstream converter drops it)
    label_shift: int = 0  # training: slot k of a block at anchor a is labelled with the token at a + k + label_shift

    def __repr__(self) -> str:
        return f"DrafterKind({self.name!r})"


_REGISTRY: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    """Add a kind to the registry; KindError if its name, an architecture or its marker is already taken."""
    if kind.name in _REGISTRY:
        raise KindError(f"a drafter kind named {kind.name!r} is already registered")
    for other in _REGISTRY.values():
        shared = set(kind.architectures) & set(other.architectures)
        if shared:
            raise KindError(f"architecture {sorted(shared)[0]!r} already converts as {other.name!r}")
        if kind.marker == other.marker:
            what = f"marker tensor {kind.marker!r}" if kind.marker else "no marker tensor (the base kind)"
            raise KindError(f"{kind.name!r}: {what} already makes a drafter {other.name!r}")
    _REGISTRY[kind.name] = kind
    return kind


def unregister(kind: DrafterKind) -> None:
    """Remove a kind registered with `register` (tests that add one take it out again)."""
    if _REGISTRY.get(kind.name) is not kind:
        raise KindError(f"{kind!r} is not registered")
    del _REGISTRY[kind.name]


def all_kinds() -> tuple[DrafterKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_REGISTRY.values())


def kind_names() -> tuple[str, ...]:
    """The registered kinds' names, in registration order."""
    return tuple(_REGISTRY)


def kind_named(name: str) -> DrafterKind:
    """The kind of this name; KindError naming the known ones otherwise."""
    kind = _REGISTRY.get(name)
    if kind is None:
        raise KindError(f"unknown drafter kind {name!r} (known: {', '.join(_REGISTRY)})")
    return kind


def architectures() -> dict[str, DrafterKind]:
    """config.json `architectures` the converter knows -> the kind each converts as."""
    return {arch: kind for kind in _REGISTRY.values() for arch in kind.architectures}


def kind_of_architecture(architecture: str) -> DrafterKind | None:
    """The kind a checkpoint of this config.json architecture converts as; None for an unknown one."""
    return architectures().get(architecture)


def kind_of_tensors(names: Iterable[str]) -> DrafterKind:
    """A drafter GGUF's kind from its tensor names, as libllama decides it: the kind whose marker tensor it
    holds, else the base kind. KindError for a file holding two kinds' markers: libllama would build both
    heads into one graph, which no converter writes and no reader of the draft handles."""
    present = set(names)
    marked = [k for k in _REGISTRY.values() if k.marker is not None and k.marker in present]
    if len(marked) > 1:
        raise KindError(
            f"holds the marker tensors of {len(marked)} drafter kinds "
            f"({', '.join(f'{k.marker} ({k.label})' for k in marked)}); a drafter is one kind"
        )
    if marked:
        return marked[0]
    return next(k for k in _REGISTRY.values() if k.marker is None)


# ---------------------------------------------------------------------------------------------------------------
# the built-in kinds


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


_U32 = (V.UINT32,)

DFLASH = register(DrafterKind(name="dflash", label="DFlash", architectures=("DFlashDraftModel",)))
"""The base kind: every drafter GGUF without another kind's marker tensor."""

DFLASH2 = register(
    DrafterKind(
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
    )
)

DSPARK = register(
    DrafterKind(
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
    )
)

"""What a drafter kind is (`DrafterKind`), the registry of them, and the rows a kind brings to the checks.

A kind is one `DrafterKind` in the registry: its name, the config.json architectures that convert as it,
its marker (the GGUF tensor whose presence makes a drafter that kind, as libllama's `load_arch_tensors`
decides, src/models/dflash.cpp; or, for a kind whose graph is the base kind's and whose difference is its
head, a metadata key), its block layout, the rows it adds to the checks of a drafter GGUF (`drafter_gguf`)
and of a checkpoint's config.json (`convert.config_schema`), and its three parts: the head (what the host
computes over the drafter's output rows, `kinds.head`), the converter hooks (`kinds.converting`) and the
training hooks (`kinds.training`, torch, imported only when asked for). Readers never decide a kind
themselves: a GGUF's kind is `kind_of_file`, a checkpoint's `kind_of_architecture`, a name's `kind_named`.

The row types (`MetaKey`, `TensorSpec`, `Hparams` for the GGUF, `ConfigKey` for config.json) live here so
that a kind can carry its own rows without importing the modules that check them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

import gguf

from ..schema import ARCH
from .converting import Converter
from .head import Head, HeadSource, LogitsHead

if TYPE_CHECKING:
    from .training import Training

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


def base_training() -> Training:
    """The base kind's training hooks (torch is imported here, never by the runtime)."""
    from .training import Training

    return Training()


@dataclass(frozen=True, eq=False)
class DrafterKind:
    """Everything that differs per drafter kind, for the converter, the GGUF checks, the runtime and the trainer.

    Compared by identity: there is one object per registered kind; nothing outside its package asks which
    kind it is, each reads the part it needs.
    """

    name: str  # "dflash2": Drafter.kind, the Steps' source name, dflash-train --kind, DrafterInfo.kind
    label: str  # "DFlash2": how people read it (--info, the TUI)
    architectures: tuple[str, ...] = ()  # config.json `architectures` that convert as this kind; [0] is dflash-train's
    marker: str | None = None  # the GGUF tensor (or host-only key) that makes a drafter this kind; None: the base kind
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
    head: Callable[[HeadSource], Head] = LogitsHead  # the runtime: what the host computes over the output rows
    converter: Converter = field(default_factory=Converter)  # what converting its checkpoints adds
    training: Callable[[], Training] = base_training  # its torch part: imports torch when called

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


def kind_of_file(names: Iterable[str]) -> DrafterKind:
    """A drafter GGUF's kind from its tensor names and metadata keys: the kind whose marker it holds (a tensor,
    as libllama decides it; a key, for a kind whose graph is the base kind's), else the base kind. KindError for a file holding two kinds' markers: libllama would
    build both heads into one graph, which no converter writes and no reader of the draft handles."""
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

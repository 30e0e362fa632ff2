"""What a drafter GGUF holds, for `dflash-convert --info`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.kinds import KindError, kind_named, kind_of_file
from dflash_gguf.schema import ARCH, Keys, Tensors, gguf_layer_to_hf
from dflash_gguf.target_gguf import field_value, open_gguf


@dataclass(frozen=True)
class DrafterInfo:
    """The facts `--info` prints; also what a caller checks before pairing a drafter."""

    path: Path
    architecture: str
    kind: str  # the DrafterKind's name, decided by kinds.kind_of_file
    name: str | None
    n_layer: int
    n_embd: int
    block_size: int | None
    target_layers: list[int]  # GGUF layer-input ids (HF target_layer_ids + 1)
    mask_token_id: int | None
    has_tokenizer: bool
    n_vocab: int | None
    tensor_types: dict[str, int]  # ggml type name -> tensor count
    n_params: int
    size_bytes: int
    fingerprint: str | None
    target_architecture: str | None
    converter_version: str | None
    markov_rank: int | None = None  # DSpark: rank of the Markov head
    has_confidence_head: bool = False  # DSpark: per-position acceptance predictions
    sample_from_anchor: bool | None = None  # DSpark: anchor-first (True) or bonus-anchor (False) block

    @property
    def hf_target_layer_ids(self) -> list[int]:
        return gguf_layer_to_hf(self.target_layers)


def drafter_info(path: str | Path) -> DrafterInfo:
    """Read a drafter GGUF's metadata; ConversionError if it is not a readable `dflash` GGUF."""
    path = Path(path)
    try:
        reader = open_gguf(path)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    arch = field_value(reader, Keys.ARCHITECTURE)
    if arch != ARCH:
        raise ConversionError(f"{path}: not a DFlash drafter (general.architecture is {arch!r}, expected {ARCH!r})")
    names = {t.name for t in reader.tensors}
    try:
        kind = kind_of_file([*names, *reader.fields])
    except KindError as e:
        raise ConversionError(f"{path}: {e}") from None
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    model = field_value(reader, Keys.TOKENIZER_MODEL)
    return DrafterInfo(
        path=path,
        architecture=arch,
        kind=kind.name,
        name=field_value(reader, Keys.NAME),
        n_layer=int(field_value(reader, Keys.BLOCK_COUNT) or 0),
        n_embd=int(field_value(reader, Keys.EMBEDDING_LENGTH) or 0),
        block_size=field_value(reader, Keys.BLOCK_SIZE),
        target_layers=list(field_value(reader, Keys.TARGET_LAYERS) or []),
        mask_token_id=field_value(reader, Keys.MASK_TOKEN_ID),
        has_tokenizer=tokens is not None,
        n_vocab=len(tokens) if tokens is not None else (field_value(reader, Keys.VOCAB_SIZE) if model == "none" else None),
        tensor_types=dict(sorted(Counter(t.tensor_type.name for t in reader.tensors).items())),
        n_params=int(sum(int(np.prod(t.shape, dtype=np.int64)) for t in reader.tensors)),
        size_bytes=path.stat().st_size,
        fingerprint=field_value(reader, Keys.TARGET_FINGERPRINT),
        target_architecture=field_value(reader, Keys.TARGET_ARCH),
        converter_version=field_value(reader, Keys.CONVERTER_VERSION),
        markov_rank=_markov_rank(reader),
        has_confidence_head=Tensors.CONF_PROJ in names,
        sample_from_anchor=_anchor(reader, kind.anchor_key) if kind.anchor_key else None,
    )


def _markov_rank(reader) -> int | None:
    for t in reader.tensors:
        if t.name == Tensors.MARKOV_W1:
            return int(t.shape[0])  # ggml order: {rank, n_vocab}
    return None


def _anchor(reader, key: str) -> bool:
    value = field_value(reader, key)
    return True if value is None else bool(value)  # libllama's default when the key is absent


def format_info(info: DrafterInfo) -> str:
    """Aligned `key: value` lines."""
    types = ", ".join(f"{name} x{count}" for name, count in info.tensor_types.items())
    target = (
        f"{info.fingerprint} ({info.target_architecture})"
        if info.fingerprint
        else "none recorded (converted without --target)"
    )
    rows = [
        ("file", str(info.path)),
        ("architecture", f"{info.architecture} ({kind_named(info.kind).label})"),
        ("name", info.name or "-"),
        ("layers", f"{info.n_layer} x {info.n_embd} hidden"),
        ("block size", str(info.block_size) if info.block_size is not None else "not set (llama.cpp assumes 16)"),
        *kind_named(info.kind).converter.info_rows(info),
        ("target layers", f"{info.target_layers} (HF target_layer_ids {info.hf_target_layer_ids})"),
        ("mask token id", str(info.mask_token_id) if info.mask_token_id is not None else "-"),
        ("tokenizer", f"{info.n_vocab} tokens" if info.has_tokenizer else f"none ({info.n_vocab} token ids)"),
        ("tensor types", types),
        ("parameters", f"{info.n_params:,}"),
        ("size", f"{info.size_bytes / 2**20:.1f} MiB ({info.size_bytes:,} bytes)"),
        ("target fingerprint", target),
        ("converter", info.converter_version or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k + ':':<{width + 1}} {v}" for k, v in rows)

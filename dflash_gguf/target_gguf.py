"""What a drafter needs to know about its target, read from the target GGUF's metadata.

The converter validates a drafter against it and copies its tokenizer; the runtime
compares fingerprints to refuse a drafter made for another model. Only metadata is
read (gguf.GGUFReader memory-maps the file), so this never calls into libllama.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import gguf
import numpy as np

from dflash_gguf.drafter_gguf import read_drafter
from dflash_gguf.schema import ARCH, Keys

# llama.cpp's llm_arch_is_recurrent / llm_arch_is_hybrid (src/llama-arch.cpp): their memory cannot be
# truncated to an earlier position; dflash_gguf.memory rolls them back with snapshots or checkpoints.
RECURRENT_ARCHS = frozenset(
    {
        "mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7",
        "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe",
        "nemotron_h", "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3",
        "kimi-k3", "glm5-next", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01",
    }
)

# llm_arch_supports_rs_rollback (src/llama-arch.cpp): libllama keeps n_rs_seq recurrent-state snapshots
# for these; elsewhere it clamps n_rs_seq to 0 and rollback takes a checkpoint and a replay.
RS_ROLLBACK_ARCHS = frozenset(
    {
        "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next",
        "nemotron_h", "nemotron_h_moe", "lfm2", "lfm2moe", "bailingmoe3",
    }
)

TOKENS_KEY = "tokenizer.ggml.tokens"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class MetadataField:
    """One GGUF key/value, in the form GGUFWriter.add_key_value takes it."""

    key: str
    value: Any
    type: gguf.GGUFValueType
    sub_type: gguf.GGUFValueType | None = None


# Architectures whose libllama 0.3.36 graph records layer inputs (`res->t_layer_inp`, src/models/*.cpp),
# and whether it also records the final hidden state (layer id n_layer). Capturing anything
# else hits a GGML_ASSERT inside llama_decode, so both the converter and the Target refuse it up front.
LAYER_CAPTURE_ARCHS: dict[str, bool] = {
    "llama": False, "qwen3": False, "qwen3moe": False, "qwen35": False, "qwen35moe": False,
    "qwen3next": False, "qwen4exp": False, "gemma4": False, "gpt-oss": False, "lfm2": False,
    "bailingmoe3": False, "hunyuan_vl": False, "minimax-01": False, "minimax-m2": False,
    "muse-glimmer": False, "nanbeige": False,
    "mimo2": True, "nemotron_h": True, "deepseek4": True,
}


def check_feature_layers(architecture: str, n_layer: int, layers: Sequence[int]) -> None:
    """ValueError unless libllama can hand over these layer inputs (GGUF ids) of such a target."""
    if architecture not in LAYER_CAPTURE_ARCHS:
        kind = "recurrent " if architecture in RECURRENT_ARCHS else ""
        raise ValueError(
            f"libllama cannot capture layer inputs of a {kind}{architecture!r} target "
            f"(supported: {', '.join(sorted(LAYER_CAPTURE_ARCHS))})"
        )
    top = n_layer if LAYER_CAPTURE_ARCHS[architecture] else n_layer - 1
    bad = [int(i) for i in layers if not 0 <= int(i) <= top]
    if bad:
        raise ValueError(f"layer ids {bad} out of range: this {architecture} target exposes layer inputs 0..{top}")


@dataclass(frozen=True)
class TargetInfo:
    """The target facts a drafter depends on."""

    path: Path
    architecture: str
    n_embd: int
    n_layer: int
    n_vocab: int
    fingerprint: str
    recurrent: bool
    mrope: bool
    tokenizer_fields: tuple[MetadataField, ...]


def fingerprint(architecture: str, n_embd: int, n_layer: int, tokens: Iterable[bytes | str]) -> str:
    """Identity of a model that survives requantization: its shape and its vocabulary.

    sha256 over architecture, embedding length, block count and every token; 16 hex chars.
    """
    h = hashlib.sha256()
    for part in (architecture, str(int(n_embd)), str(int(n_layer))):
        h.update(part.encode("utf-8") + b"\0")
    for token in tokens:
        h.update((token.encode("utf-8") if isinstance(token, str) else bytes(token)) + b"\0")
    return h.hexdigest()[:16]


def _field_value(field: gguf.ReaderField) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    """A reader field's value with strings kept as raw bytes (tokens need not be valid UTF-8)."""
    main = field.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], main, sub
        return [v for i in field.data for v in field.parts[i].tolist()], main, sub
    if main == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]), main, None
    return field.parts[-1].tolist()[0], main, None


def _scalar(fields: dict[str, gguf.ReaderField], key: str, path: Path) -> Any:
    field = fields.get(key)
    if field is None or not field.types or field.types[0] == gguf.GGUFValueType.ARRAY:
        raise ValueError(f"{path}: not a model GGUF: no {key}")
    value, _, _ = _field_value(field)
    return value.decode("utf-8") if isinstance(value, bytes) else value


class FastGGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader, 4x faster on big vocabularies: it slices a plain ndarray view of the map.

    Every one of the ~250k header reads of a 49k-token tokenizer otherwise goes through
    np.memmap's slicing and __array_finalize__ (seconds per file). Overrides the private
    `_get` of the pinned gguf==0.19.0 with the same semantics.
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        data = self.data
        if type(data) is not np.ndarray:
            data = self.data = data.view(np.ndarray)
        dtype = np.dtype(dtype)
        count = int(count)
        arr = data[offset : offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A GGUF reader, with one clear ValueError for a missing, truncated or non-GGUF file."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    try:
        return FastGGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({reason})") from None


def read_target_info(path: str | Path) -> TargetInfo:
    """The target facts of a model GGUF; ValueError with a one-line message on a bad file."""
    path = Path(path)
    reader = open_gguf(path)
    fields = reader.fields
    arch = _scalar(fields, Keys.ARCHITECTURE, path)
    n_embd = int(_scalar(fields, f"{arch}.embedding_length", path))
    n_layer = int(_scalar(fields, f"{arch}.block_count", path))
    tokens_field = fields.get(TOKENS_KEY)
    if tokens_field is None:
        raise ValueError(f"{path}: the target GGUF has no tokenizer ({TOKENS_KEY})")
    tokens, _, _ = _field_value(tokens_field)
    sections = fields.get(f"{arch}.rope.dimension_sections")
    mrope = sections is not None and any(_field_value(sections)[0])
    tokenizer_fields = tuple(
        MetadataField(key, *_field_value(field))
        for key, field in fields.items()
        if key.startswith(Keys.TOKENIZER_PREFIX) and key != Keys.MASK_TOKEN_ID
    )
    return TargetInfo(
        path=path,
        architecture=arch,
        n_embd=n_embd,
        n_layer=n_layer,
        n_vocab=len(tokens),
        fingerprint=fingerprint(arch, n_embd, n_layer, tokens),
        recurrent=arch in RECURRENT_ARCHS,
        mrope=bool(mrope),
        tokenizer_fields=tokenizer_fields,
    )


def field_value(reader: gguf.GGUFReader, key: str) -> Any:
    """A metadata value (strings decoded, arrays as lists) or None when absent."""
    field = reader.fields.get(key)
    if field is None or not field.types:
        return None
    value, main, sub = _field_value(field)
    if main == gguf.GGUFValueType.STRING:
        return value.decode("utf-8", errors="replace")
    if sub == gguf.GGUFValueType.STRING:
        return [v.decode("utf-8", errors="replace") for v in value]
    return value


def trained_context(path: str | Path) -> int | None:
    """The context a model GGUF was trained for (`{arch}.context_length`), or None where it does not say."""
    reader = open_gguf(Path(path))
    arch = field_value(reader, Keys.ARCHITECTURE)
    n = field_value(reader, f"{arch}.context_length") if arch else None
    return int(n) if isinstance(n, (int, np.integer)) and n > 0 else None


def drafter_verify_tokens(path: str | Path) -> int:
    """The longest verify batch a drafter GGUF's blocks make, from its header alone, so a target context can
    be sized for it first (`drafter_gguf.DrafterFile.verify_tokens`: the block, one more for an anchor-first
    kind, whose slot 0 drafts too). ValueError for a file that is not a readable `dflash` drafter."""
    drafter = read_drafter(path)
    if drafter is None:
        raise ValueError(f"{path}: not a dflash drafter (general.architecture is not {ARCH!r})")
    return drafter.verify_tokens

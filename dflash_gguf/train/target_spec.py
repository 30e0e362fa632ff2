"""What the trainer takes from the target GGUF: geometry, frozen embedding/head, the mask token.

Read with gguf-py only (no libllama), so a bad target is refused before anything loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..target_gguf import TargetInfo, check_feature_layers, field_value, open_gguf, read_target_info
from .errors import TrainError

_CONTROL = int(gguf.TokenType.CONTROL)
_SPECIAL_ID_KEYS = ("bos", "eos", "eot", "eom", "unknown", "padding", "sep", "cls", "mask")


@dataclass(frozen=True)
class TargetSpec:
    info: TargetInfo
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    rms_eps: float
    rope_theta: float
    context_length: int
    mask_token_id: int
    mask_token_text: str
    eog_ids: tuple[int, ...]  # end-of-generation tokens (eos, eot, eom)


def read_target_spec(path: Path, mask_token_id: int | None = None) -> TargetSpec:
    """Geometry of a target the recipe supports; TrainError for a missing/unsupported one."""
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"target not found: {path}")
    try:
        info = read_target_info(path)
        reader = open_gguf(path)
    except ValueError as e:
        raise TrainError(str(e)) from None
    # recurrent/hybrid targets are fine: data generation decodes plainly and only ever clears whole
    # sequences, which their memory supports (rollback is the runtime's business, dflash_gguf.memory);
    # what cannot work is a target whose layer inputs libllama cannot capture (mamba, rwkv, ...)
    try:
        check_feature_layers(info.architecture, info.n_layer, [0])
    except ValueError as e:
        raise TrainError(f"{path}: {e}") from None
    arch = info.architecture

    def key(name: str, default=None):
        value = field_value(reader, f"{arch}.{name}")
        if value is None and default is None:
            raise TrainError(f"{path}: the target GGUF has no {arch}.{name}")
        return default if value is None else value

    n_head = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", info.n_embd // n_head))
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    types = field_value(reader, "tokenizer.ggml.token_type") or []
    if mask_token_id is None:
        mask_token_id = choose_mask_token(reader, tokens, types)
    elif not 0 <= mask_token_id < info.n_vocab:
        raise TrainError(f"mask token id {mask_token_id} outside the target vocabulary [0, {info.n_vocab})")
    return TargetSpec(
        info=info,
        n_head=n_head,
        n_head_kv=_per_layer_max(key("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_ff=int(key("feed_forward_length")),
        rms_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        context_length=int(key("context_length", 4096)),
        mask_token_id=int(mask_token_id),
        mask_token_text=tokens[mask_token_id],
        eog_ids=tuple(
            int(v) for k in ("eos", "eot", "eom") if (v := field_value(reader, f"tokenizer.ggml.{k}_token_id")) is not None
        ),
    )


def _per_layer_max(value) -> int:
    """A per-layer array (hybrid targets: 0 for recurrent layers) as its attention layers' value."""
    return max(int(v) for v in value) if isinstance(value, list) else int(value)


def choose_mask_token(reader: gguf.GGUFReader, tokens: list[str], types: list[int]) -> int:
    """The mask id for a target with no spare vocabulary row: its last control token that has no
    role (not bos/eos/pad/unk/...) and that its chat template never writes.

    The drafter only needs a fixed, recognisable input row; a role-less control token never occurs
    in chat text, so the embedding it borrows carries no meaning the drafter must unlearn.
    (SmolLM2: `<empty_output>`, id 16, a Jupyter-notebook marker from pretraining.)
    """
    if (given := field_value(reader, "tokenizer.ggml.mask_token_id")) is not None:
        return int(given)
    taken = {field_value(reader, f"tokenizer.ggml.{k}_token_id") for k in _SPECIAL_ID_KEYS}
    template = field_value(reader, "tokenizer.chat_template") or ""
    for i in range(len(types) - 1, -1, -1):
        if types[i] == _CONTROL and i not in taken and tokens[i] not in template:
            return i
    raise TrainError("the target has no unused control token to serve as mask token; pass --mask-token-id")


def _tensor(reader: gguf.GGUFReader, name: str) -> np.ndarray | None:
    for t in reader.tensors:
        if t.name == name:
            return gguf.quants.dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))
    return None


def read_embedding_and_head(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(token embedding, LM head), each (n_vocab, n_embd) float32, dequantized from the GGUF.

    A target without `output.weight` ties its head to the embedding (SmolLM2 does).
    """
    reader = open_gguf(Path(path))
    embed = _tensor(reader, "token_embd.weight")
    if embed is None:
        raise TrainError(f"{path}: the target GGUF has no token_embd.weight")
    head = _tensor(reader, "output.weight")
    return embed.astype(np.float32), (embed if head is None else head).astype(np.float32)

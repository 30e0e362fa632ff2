"""A drafter's own mask row (`mask_embedding.pt` beside config.json, as MiMo's drafters ship it).

The target's embedding row for the mask token is untrained in such models, so the drafter brings its own
vector. As upstream's converter does (conversion/qwen.py DFlashModel), the drafter GGUF then carries the
embedding table (its own `embed_tokens`, else the target's) with that row replaced, and an output head kept
apart from it (its own `lm_head`, else the target's; a full-vocabulary DSpark drafter writes none).
The .pt is a pickle: it is read only with torch's `weights_only` loader, never with plain pickle.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from dflash_gguf.convert.checkpoint import Checkpoint, DraftConfig, writes_full_vocab_head
from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.convert.safetensors_reader import check_regular_file
from dflash_gguf.schema import Tensors
from dflash_gguf.target_gguf import TargetInfo, open_gguf

MASK_FILE = "mask_embedding.pt"


@dataclass(frozen=True, eq=False)
class ArrayTensor:
    """A tensor computed before writing (CheckpointTensor's interface): `file` is the input it comes from."""

    name: str
    dtype: str  # the safetensors spelling of the type it is written as when no --outtype is given
    data: np.ndarray
    file: Path

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def read(self) -> np.ndarray:
        return self.data


def read_mask_row(path: Path, cfg: DraftConfig) -> np.ndarray:
    """The mask vector of `mask_embedding.pt` ({"mask_token_id": int, "embedding": [hidden]}), checked against config.json."""
    check_regular_file(path, MASK_FILE)
    try:
        import torch
    except ImportError:
        raise ConversionError(f"{path}: reading {MASK_FILE} needs torch (pip install torch); nothing else in dflash-convert does") from None
    try:
        with warnings.catch_warnings():  # torch warns on stderr about pickle protocols: the CLI says one line only
            warnings.simplefilter("ignore")
            data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses anything but tensors and plain containers, each way its own error type
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConversionError(f"{path}: cannot read {MASK_FILE} with torch's weights-only loader ({reason[:160]})") from None
    if not isinstance(data, dict) or not {"mask_token_id", "embedding"} <= set(data):
        raise ConversionError(f"{path}: {MASK_FILE} must hold a dict with mask_token_id and embedding")
    mask_id, row = data["mask_token_id"], data["embedding"]
    if isinstance(mask_id, torch.Tensor) and mask_id.numel() == 1 and not mask_id.is_floating_point():
        mask_id = int(mask_id.item())
    if isinstance(mask_id, bool) or not isinstance(mask_id, int) or mask_id != cfg.mask_token_id:
        raise ConversionError(f"{path}: mask_token_id {mask_id!r} does not match config.json's {cfg.mask_token_id}")
    if not isinstance(row, torch.Tensor) or not row.is_floating_point() or tuple(row.shape) != (cfg.hidden_size,):
        shape = list(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
        raise ConversionError(f"{path}: embedding must be a float tensor of shape [{cfg.hidden_size}], got {shape}")
    values = row.detach().to(torch.float32).numpy()
    if not np.isfinite(values).all():
        raise ConversionError(f"{path}: embedding holds NaN or infinite values")
    return values


def _target_tensors(target: TargetInfo) -> dict[str, gguf.ReaderTensor]:
    try:
        return {t.name: t for t in open_gguf(Path(target.path)).tensors}
    except ValueError as e:
        raise ConversionError(str(e)) from None


def target_matrix(target: TargetInfo, tensors: dict[str, gguf.ReaderTensor], name: str, shape: tuple[int, int]) -> np.ndarray:
    """A target GGUF tensor (`token_embd.weight`, `output.weight`) dequantized to float32, in HF (rows, cols) order."""
    t = tensors.get(name)
    if t is None:
        raise ConversionError(f"{target.path}: the target GGUF has no {name}")
    try:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
    except (NotImplementedError, ValueError) as e:
        raise ConversionError(f"{target.path}: cannot dequantize {name} ({t.tensor_type.name}: {e})") from None
    data = np.asarray(data, dtype=np.float32)
    if data.shape != shape:
        raise ConversionError(f"{target.path}: {name} has shape {list(data.shape)}, the drafter needs {list(shape)}")
    return data


def with_mask_embedding(ckpt: Checkpoint, target: TargetInfo | None) -> Checkpoint:
    """`ckpt` with its mask row patched in, when `mask_embedding.pt` sits beside config.json; else `ckpt` itself."""
    path = ckpt.config_path.parent / MASK_FILE
    if not os.path.lexists(path):
        return ckpt
    cfg = ckpt.config
    row = read_mask_row(path, cfg)
    shape = (cfg.vocab_size, cfg.hidden_size)
    dtype = ckpt.tensors[Tensors.FC].dtype  # written like the drafter's other matrices
    tensors = dict(ckpt.tensors)
    needs_head = Tensors.OUTPUT not in tensors and writes_full_vocab_head(cfg)
    if target is None and (Tensors.TOKEN_EMBD not in tensors or needs_head):
        raise ConversionError(
            f"{path}: a drafter with its own mask row needs --target TARGET.gguf (the target's embeddings and output head)"
        )
    own = tensors.get(Tensors.TOKEN_EMBD)
    from_target = _target_tensors(target) if target is not None and (own is None or needs_head) else {}
    if needs_head:
        head = Tensors.OUTPUT if Tensors.OUTPUT in from_target else Tensors.TOKEN_EMBD  # a tied target has no output.weight
        data = target_matrix(target, from_target, head, shape)
        tensors[Tensors.OUTPUT] = ArrayTensor(Tensors.OUTPUT, dtype, data, Path(target.path))
    table = own.read().copy() if own is not None else target_matrix(target, from_target, Tensors.TOKEN_EMBD, shape)
    table[cfg.mask_token_id] = row
    tensors[Tensors.TOKEN_EMBD] = ArrayTensor(Tensors.TOKEN_EMBD, own.dtype if own is not None else dtype, table, path)
    return replace(ckpt, tensors=tensors)

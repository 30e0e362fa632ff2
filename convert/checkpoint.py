"""A DFlash / DFlash2 / DSpark checkpoint on disk: its config and its tensors, validated.

Everything that can be wrong with the input is found here, before an output file is
opened: the config, the architecture, the set of tensors and every tensor's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dflash_gguf.convert.config_schema import check_config, check_named, load_config_json
from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.convert.safetensors_reader import CheckpointTensor, check_regular_file, read_safetensors_index
from dflash_gguf.kinds import DrafterKind, KindError, architectures, kind_of_architecture
from dflash_gguf.kinds.converting import draft_value
from dflash_gguf.schema import DEFAULT_BLOCK_SIZE, HF_IGNORED, HF_TO_GGUF, Tensors, gguf_tensor_name

REFUSED_ARCHITECTURES = {
    "Gemma4DSparkModel": "its Gemma-4 layers (k = v attention, per-layer scales) are not the Qwen3 layers dflash-convert writes",
    "DeepseekV4DSparkModel": "its DeepSeek-V4 MTP layers (MoE, hyper-connections) are not the Qwen3 layers dflash-convert writes",
}
"""Drafters upstream's converter registers on other model classes: refused in one line, with the reason."""

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")  # what llama.cpp's dflash loader accepts


@dataclass(frozen=True)
class DraftConfig:
    """The config.json facts the GGUF needs, with z-lab's `dflash_config` overrides applied."""

    kind: DrafterKind  # from the architecture (kinds.kind_of_architecture)
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int | None  # reduced draft vocabulary (`d2t` + own lm_head); None = the target's
    rms_norm_eps: float
    target_layer_ids: tuple[int, ...]  # HF: indices of target layer outputs
    block_size: int
    mask_token_id: int
    hparams: dict[str, Any]  # the whole config.json, for the optional keys
    sample_from_anchor: bool | None = None  # a kind with a block-layout key: anchor-first (slot 0 predicts) or bonus anchor
    kind_values: dict[str, Any] = field(default_factory=dict)  # what the kind's converter read (DSpark: markov_rank)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference model's rule when a config names no target layers (dflash.model.build_target_layer_ids)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def _int(hparams: dict[str, Any], name: str, path: Path, *, positive: bool = True) -> int:
    value = draft_value(hparams, name)
    if value is None:
        raise ConversionError(f"{path}: missing {name}")
    if isinstance(value, bool) or not isinstance(value, int) or (positive and value <= 0) or value < 0:
        raise ConversionError(f"{path}: {name} must be a {'positive' if positive else 'non-negative'} integer, got {value!r}")
    return value


def read_config(path: Path) -> DraftConfig:
    """Parse and check config.json; ConversionError names the first problem."""
    if not path.exists() and not path.is_symlink():
        raise ConversionError(f"{path}: missing config.json (it must sit beside the safetensors)")
    hparams = load_config_json(path)
    if not isinstance(hparams, dict):
        raise ConversionError(f"{path}: invalid config.json (not a JSON object)")
    if not isinstance(hparams.get("dflash_config", {}), dict):
        raise ConversionError(f"{path}: invalid config.json (dflash_config is not an object)")

    archs = hparams.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ConversionError(f"{path}: config.json names no architectures (expected one of {', '.join(architectures())})")
    if not all(isinstance(a, str) for a in archs):
        raise ConversionError(f"{path}: architectures must be a list of class names, got {str(archs)[:60]}")
    known = [a for a in archs if kind_of_architecture(a) is not None]
    refused = [a for a in archs if a in REFUSED_ARCHITECTURES]
    if not known and refused:
        raise ConversionError(
            f"{path}: architecture {refused[0]} is not supported by dflash-convert ({REFUSED_ARCHITECTURES[refused[0]]}); "
            f"convert it with llama.cpp's convert_hf_to_gguf.py"
        )
    if not known:
        raise ConversionError(
            f"{path}: unknown architecture {archs[0]!r} (expected one of {', '.join(architectures())})"
        )
    arch = known[0]
    kind = kind_of_architecture(arch)
    # the kind's own schema brought to the DFlash one (DSpark's checks the keys it reads, before it reads them)
    hparams, sample_from_anchor, kind_values = kind.converter.read_config(
        hparams, lambda names, values, prefix: check_named(values, path, kind, names, prefix))
    check_config(hparams, path, kind)  # every key's type and range, from one table (config_schema.SCHEMA)

    hidden = _int(hparams, "hidden_size", path)
    num_heads = _int(hparams, "num_attention_heads", path)
    head_dim = hparams.get("head_dim") or hidden // num_heads
    num_layers = _int(hparams, "num_hidden_layers", path)
    eps = draft_value(hparams, "rms_norm_eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ConversionError(f"{path}: rms_norm_eps must be a positive number, got {eps!r}")

    layer_ids = draft_value(hparams, "target_layer_ids")
    if layer_ids is None:
        if draft_value(hparams, "num_target_layers") is None:
            raise ConversionError(f"{path}: config.json has neither target_layer_ids nor num_target_layers")
        layer_ids = default_target_layer_ids(_int(hparams, "num_target_layers", path), num_layers)
    if not isinstance(layer_ids, list) or not layer_ids or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids
    ):
        raise ConversionError(f"{path}: target_layer_ids must be a non-empty list of non-negative integers, got {layer_ids!r}")

    act = hparams.get("hidden_act", "silu")
    if act not in HIDDEN_ACTS:
        raise ConversionError(f"{path}: hidden_act {act!r} is not supported by llama.cpp's dflash (use {', '.join(HIDDEN_ACTS)})")

    if draft_value(hparams, "mask_token_id") is None:
        raise ConversionError(f"{path}: config.json has no mask_token_id (top level or dflash_config)")
    vocab = _int(hparams, "vocab_size", path)
    mask_id = _int(hparams, "mask_token_id", path, positive=False)
    if mask_id >= vocab:
        raise ConversionError(f"{path}: mask_token_id {mask_id} is outside the vocabulary of {vocab}")

    draft_vocab = hparams.get("draft_vocab_size")
    if draft_vocab is not None:
        draft_vocab = _int(hparams, "draft_vocab_size", path)
        if draft_vocab > vocab:
            raise ConversionError(f"{path}: draft_vocab_size {draft_vocab} exceeds vocab_size {vocab}")
        if draft_vocab == vocab:
            draft_vocab = None
        elif not kind.reduced_vocab:
            raise ConversionError(f"{path}: a reduced draft vocabulary is not supported for {kind.label} (its selector spans the full vocabulary)")

    return DraftConfig(
        kind=kind,
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=_int(hparams, "intermediate_size", path),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=_int(hparams, "num_key_value_heads", path),
        head_dim=int(head_dim),
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
        rms_norm_eps=float(eps),
        target_layer_ids=tuple(layer_ids),
        block_size=_int(hparams, "block_size", path) if draft_value(hparams, "block_size") is not None else DEFAULT_BLOCK_SIZE,
        mask_token_id=mask_id,
        hparams=hparams,
        sample_from_anchor=sample_from_anchor,
        kind_values=kind_values,
    )


def writes_full_vocab_head(cfg: DraftConfig) -> bool:
    """Whether a full-vocabulary output head goes into the GGUF: not for DSpark, whose upstream converter drops it
    (libllama then scores with the target's head)."""
    return cfg.kind.full_vocab_head or cfg.draft_vocab_size is not None


def expected_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> required HF (numpy) shape, for the tensors every drafter must have."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv, ff = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        Tensors.FC: (h, len(cfg.target_layer_ids) * h),
        Tensors.HIDDEN_NORM: (h,),
        Tensors.OUTPUT_NORM: (h,),
    }
    per_layer = {
        Tensors.ATTN_NORM: (h,),
        Tensors.ATTN_Q: (q, h),
        Tensors.ATTN_K: (kv, h),
        Tensors.ATTN_V: (kv, h),
        Tensors.ATTN_OUT: (h, q),
        Tensors.ATTN_Q_NORM: (hd,),
        Tensors.ATTN_K_NORM: (hd,),
        Tensors.FFN_NORM: (h,),
        Tensors.FFN_GATE: (ff, h),
        Tensors.FFN_UP: (ff, h),
        Tensors.FFN_DOWN: (h, ff),
    }
    whole, own_per_layer = cfg.kind.converter.shapes(cfg)  # the kind's own tensors
    shapes.update(whole)
    per_layer.update(own_per_layer)
    if cfg.draft_vocab_size is not None:
        # reduced vocabulary: the draft rows' target ids (as offsets, upstream's convention) and their own head
        shapes[Tensors.D2T] = (cfg.draft_vocab_size,)
        shapes[Tensors.OUTPUT] = (cfg.draft_vocab_size, h)
    for bid in range(cfg.num_layers):
        shapes.update({name.format(bid=bid): shape for name, shape in per_layer.items()})
    return shapes


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: its config and GGUF name -> source tensor, in writing order."""

    source: Path  # what the user named (file or directory)
    config_path: Path
    config: DraftConfig
    tensors: dict[str, CheckpointTensor]


def _weight_files(src: Path) -> tuple[Path, list[Path]]:
    """(directory holding config.json, safetensors files) for a file, index or directory argument."""
    if not src.exists():
        raise ConversionError(f"{src}: no such file or directory")
    if src.is_dir():
        index = src / SHARD_INDEX
        single = src / SINGLE_FILE
        if index.is_file():
            return src, _shards(index)
        if single.is_file():
            return src, [single]
        found = sorted(src.glob("*.safetensors"))
        if found:
            return src, found
        pickles = sorted(p for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            _refuse_pickle(pickles[0])
        raise ConversionError(f"{src}: no safetensors checkpoint in this directory")
    if src.suffix in PICKLE_SUFFIXES:
        _refuse_pickle(src)
    if src.name.endswith(".index.json"):
        return src.parent, _shards(src)
    if src.suffix != ".safetensors":
        raise ConversionError(f"{src}: not a safetensors checkpoint (expected .safetensors, an index .json or a directory)")
    return src.parent, [src]


def _refuse_pickle(path: Path) -> None:
    raise ConversionError(
        f"{path}: pickle checkpoints are refused (loading them can run arbitrary code); save the model as safetensors"
    )


def _shards(index: Path) -> list[Path]:
    data = load_config_json(index, "safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
        raise ConversionError(f"{index}: invalid safetensors index (weight_map must map tensor names to shard file names)")
    files = sorted(set(weight_map.values()))
    paths = [index.parent / f for f in files]
    for p in paths:
        if not p.exists():
            raise ConversionError(f"{index}: names shard {p.name}, which does not exist")
        check_regular_file(p, "safetensors shard")
    return paths


def load_checkpoint(src: str | Path) -> Checkpoint:
    """Find, parse and fully validate a checkpoint. Reads headers only, never tensor data."""
    src = Path(src)
    directory, files = _weight_files(src)
    config_path = directory / CONFIG_FILE
    cfg = read_config(config_path)

    found: dict[str, CheckpointTensor] = {}
    for file in files:
        for hf_name, tensor in read_safetensors_index(file).items():
            if HF_IGNORED.search(hf_name):
                continue
            name = gguf_tensor_name(hf_name)
            if name is None:
                raise ConversionError(f"{file}: unexpected tensor {hf_name} for a {cfg.architecture}")
            if name in found:
                raise ConversionError(f"{file}: tensor {hf_name} appears twice")
            found[name] = tensor

    if Tensors.OUTPUT in found and not writes_full_vocab_head(cfg):
        del found[Tensors.OUTPUT]  # as upstream: a full-vocabulary DSpark drafter's lm_head is not written
    try:
        cfg = replace(cfg, kind_values=cfg.kind.converter.complete(cfg, found, directory))  # DSpark: its Markov rank
    except KindError as e:
        raise ConversionError(str(e)) from None
    required = expected_shapes(cfg)
    for name, shape in required.items():
        tensor = found.get(name)
        if tensor is None:
            where = files[0] if len(files) == 1 else directory
            raise ConversionError(
                f"{where}: missing tensor {_hf_name(name, cfg.num_layers)} "
                f"(config.json describes a {cfg.num_layers}-layer {cfg.architecture})"
            )
        if tensor.shape != shape:
            raise ConversionError(
                f"{tensor.file}: tensor {tensor.name} has shape {list(tensor.shape)}, config.json implies {list(shape)}"
            )
    for name, tensor in found.items():
        if name not in required and _optional_shape(cfg, name, tensor) is None:
            raise ConversionError(f"{tensor.file}: unexpected tensor {tensor.name} for this config")

    if Tensors.D2T in found:
        check_d2t(found[Tensors.D2T], cfg)

    ordered = {name: found[name] for name in required}
    ordered.update({name: t for name, t in found.items() if name not in ordered})
    return Checkpoint(source=src, config_path=config_path, config=cfg, tensors=ordered)


def d2t_target_ids(tensor: CheckpointTensor) -> np.ndarray:
    """The absolute target token id of every draft row: checkpoints store offsets (id - row), GGUF ids."""
    offsets = tensor.read()
    return offsets + np.arange(offsets.size, dtype=np.int64)


def check_d2t(tensor: CheckpointTensor, cfg: DraftConfig) -> None:
    """The draft-to-target map must name distinct target tokens inside the vocabulary."""
    if tensor.dtype not in ("I64", "I32"):
        raise ConversionError(f"{tensor.file}: tensor {tensor.name} must hold integers, not {tensor.dtype}")
    ids = d2t_target_ids(tensor)
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ConversionError(f"{tensor.file}: tensor {tensor.name} maps draft rows outside the vocabulary of {cfg.vocab_size}")
    if np.unique(ids).size != ids.size:
        raise ConversionError(f"{tensor.file}: tensor {tensor.name} maps two draft rows to the same target token")


def _hf_name(gguf_name: str, num_layers: int) -> str:
    """The checkpoint name of a GGUF tensor, for messages."""
    for hf, name in HF_TO_GGUF.items():
        for bid in range(num_layers) if "{bid}" in name else (0,):
            if name.format(bid=bid) == gguf_name:
                return hf.format(bid=bid)
    return gguf_name


def _optional_shape(cfg: DraftConfig, name: str, tensor: CheckpointTensor) -> tuple[int, ...] | None:
    """The shape an optional tensor (own embeddings, own full-vocabulary head, sinks, confidence head) must have;
    None if not allowed."""
    if name == Tensors.D2T:
        raise ConversionError(f"{tensor.file}: tensor {tensor.name} needs draft_vocab_size in config.json")
    optional = {Tensors.ATTN_SINKS.format(bid=b): (cfg.num_heads,) for b in range(cfg.num_layers)}
    try:
        optional.update(cfg.kind.converter.optional_shapes(cfg, name, tensor.shape))  # DSpark: its confidence head
    except KindError as e:
        raise ConversionError(f"{tensor.file}: tensor {tensor.name} {e}") from None
    if name in optional:
        if tensor.shape != optional[name]:
            raise ConversionError(
                f"{tensor.file}: tensor {tensor.name} has shape {list(tensor.shape)}, config.json implies {list(optional[name])}"
            )
        return optional[name]
    if name not in (Tensors.TOKEN_EMBD, Tensors.OUTPUT):
        return None
    shape = (cfg.vocab_size, cfg.hidden_size)
    if tensor.shape != shape:
        raise ConversionError(f"{tensor.file}: tensor {tensor.name} has shape {list(tensor.shape)}, config.json implies {list(shape)}")
    return shape

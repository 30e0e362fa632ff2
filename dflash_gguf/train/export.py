"""The drafter GGUF, through the project's converter, from the run's best checkpoint."""

from __future__ import annotations

from pathlib import Path

from ..convert import ConversionError, convert_checkpoint
from .config import TrainConfig
from .errors import TrainError


def export(cfg: TrainConfig) -> Path:
    """Convert OUT/checkpoints/best (else last) to `cfg.gguf_path`, validated against the target.

    A reduced draft vocabulary goes in as `d2t` (absolute I64 ids) plus the drafter's own head.
    """
    ckpt = Path(cfg.out) / "checkpoints"
    src = ckpt / "best" if (ckpt / "best").is_dir() else ckpt / "last"
    if not src.is_dir():
        raise TrainError(f"no checkpoint in {ckpt}: run the train stage first")
    name = f"{Path(cfg.target).name.removesuffix('.gguf')}-DFlash"  # the GGUF names what it drafts for
    try:
        return convert_checkpoint(
            src, cfg.gguf_path, target=cfg.target, outtype=cfg.outtype, force=True, progress=False, name=name
        )
    except ConversionError as e:
        raise TrainError(str(e)) from None

"""The drafter GGUF, through the project's converter, from the run's best checkpoint."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from ..convert import ConversionError, convert_checkpoint
from .config import TrainConfig
from .errors import TrainError
from .model import CHECKPOINT_CONFIG, CHECKPOINT_WEIGHTS

DRAFT_VOCAB_TENSORS = ("d2t", "t2d", "lm_head.weight")


def full_head_checkpoint(src: Path, dst: Path) -> Path:
    """A copy of a reduced-vocabulary checkpoint that proposes over the target's whole LM head.

    The trained head rows are frozen copies of the target's, so dropping `d2t` and the own head
    leaves the same hidden states scored by every target row: the layout every DFlash runtime reads.
    """
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(str(src / CHECKPOINT_WEIGHTS)).items() if k not in DRAFT_VOCAB_TENSORS}
    cfg = json.loads((src / CHECKPOINT_CONFIG).read_text())
    cfg.pop("draft_vocab_size", None)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / CHECKPOINT_WEIGHTS), metadata={"format": "pt"})
    (dst / CHECKPOINT_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return dst


def export(cfg: TrainConfig) -> tuple[Path, str]:
    """Convert OUT/checkpoints/best (else last) to `cfg.gguf_path`; (path, a note on the head used).

    A reduced draft vocabulary goes into the GGUF as `d2t` + own head when the converter takes it;
    otherwise the drafter is written with the target's full head.
    """
    ckpt = Path(cfg.out) / "checkpoints"
    src = ckpt / "best" if (ckpt / "best").is_dir() else ckpt / "last"
    if not src.is_dir():
        raise TrainError(f"no checkpoint in {ckpt}: run the train stage first")
    reduced = "draft_vocab_size" in json.loads((src / CHECKPOINT_CONFIG).read_text())
    try:
        return convert_checkpoint(src, cfg.gguf_path, target=cfg.target, outtype=cfg.outtype, force=True, progress=False), ""
    except ConversionError as e:
        if not reduced:
            raise TrainError(str(e)) from None
        refusal = str(e)
    tmp = Path(tempfile.mkdtemp(prefix="full-head-", dir=ckpt))
    try:
        full = full_head_checkpoint(src, tmp)
        path = convert_checkpoint(full, cfg.gguf_path, target=cfg.target, outtype=cfg.outtype, force=True, progress=False)
    except ConversionError as e:
        raise TrainError(str(e)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, f" (with the target's full LM head: the converter refused the draft vocabulary: {refusal})"

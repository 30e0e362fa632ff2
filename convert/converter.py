"""checkpoint -> drafter GGUF: validate everything, then write."""

from __future__ import annotations

from pathlib import Path

from dflash_gguf.convert.checkpoint import Checkpoint, load_checkpoint
from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.convert.mask_embedding import with_mask_embedding
from dflash_gguf.convert.writer import OUTTYPES, write_drafter_gguf
from dflash_gguf.schema import hf_layer_to_gguf
from dflash_gguf.target_gguf import TargetInfo, check_feature_layers, read_target_info


def check_pair(ckpt: Checkpoint, target: TargetInfo) -> None:
    """Refuse a drafter that cannot run on this target, before any byte is written."""
    cfg = ckpt.config
    where = f"{target.path}"
    if cfg.hidden_size != target.n_embd:
        raise ConversionError(
            f"{where}: target hidden size {target.n_embd} does not match the drafter's {cfg.hidden_size} ({ckpt.config_path})"
        )
    try:
        check_feature_layers(target.architecture, target.n_layer, hf_layer_to_gguf(list(cfg.target_layer_ids)))
    except ValueError as e:
        raise ConversionError(
            f"{where}: the drafter reads target layers {list(cfg.target_layer_ids)} (HF target_layer_ids), "
            f"which this {target.n_layer}-layer target cannot hand over: {e} ({ckpt.config_path})"
        ) from None
    if cfg.vocab_size != target.n_vocab:
        raise ConversionError(
            f"{where}: target vocabulary has {target.n_vocab} tokens, the drafter's {cfg.vocab_size} ({ckpt.config_path})"
        )
    if not 0 <= cfg.mask_token_id < target.n_vocab:
        raise ConversionError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the target vocabulary of {target.n_vocab}")


def convert_checkpoint(
    src: Path,
    out: Path,
    *,
    target: Path | None = None,
    outtype: str | None = None,
    force: bool = False,
    progress: bool = True,
    name: str | None = None,
) -> Path:
    """Convert a DFlash / DFlash2 / DSpark safetensors checkpoint (file, shard index or directory) to a drafter GGUF.

    With `target`, the target GGUF's tokenizer and fingerprint are copied in and the pair is
    validated first; a `mask_embedding.pt` beside config.json is patched into the embedding table. `name` is the GGUF's `general.name` (default: OUT's stem). Raises
    ConversionError (one line, naming the file) on any bad input; no output is left behind then.
    """
    if outtype is not None and outtype not in OUTTYPES:
        raise ConversionError(f"{out}: unknown outtype {outtype!r} (expected one of {', '.join(OUTTYPES)})")
    ckpt = load_checkpoint(src)
    target_info = None
    if target is not None:
        try:
            target_info = read_target_info(target)
        except ValueError as e:
            raise ConversionError(str(e)) from None
        check_pair(ckpt, target_info)
    ckpt = with_mask_embedding(ckpt, target_info)
    return write_drafter_gguf(
        ckpt, Path(out), target=target_info, outtype=outtype, force=force, progress=progress, name=name
    )

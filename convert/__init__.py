"""dflash-convert: DFlash / DFlash2 (z-lab) and DSpark (DeepSpec, speculators) safetensors checkpoints -> `dflash` GGUF drafters."""

from dflash_gguf.convert.converter import check_pair, convert_checkpoint
from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.convert.info import DrafterInfo, drafter_info, format_info

__all__ = ["ConversionError", "DrafterInfo", "check_pair", "convert_checkpoint", "drafter_info", "format_info"]

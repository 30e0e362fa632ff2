"""dflash-convert: z-lab DFlash / DFlash2 safetensors checkpoints -> `dflash` GGUF drafters."""

from dflash_gguf.convert.converter import check_pair, convert_checkpoint
from dflash_gguf.convert.errors import ConversionError

__all__ = ["ConversionError", "check_pair", "convert_checkpoint"]

"""What a drafter kind adds to converting a checkpoint (dflash-convert); the base kind adds nothing.

The converter (`dflash_gguf.convert`) calls these hooks where a kind's checkpoint differs: its config.json
schema, the tensors it must or may hold, the metadata it writes, the lines `--info` shows. A hook gets the
converter's own objects (its `DraftConfig` as `cfg`, its checkpoint tensors, `--info`'s `DrafterInfo`) and
reads only their documented fields; a problem is a `KindError` carrying the whole message, which the
converter reports as a `ConversionError`.
"""

from __future__ import annotations

from typing import Any, Callable

import gguf

Shape = tuple[int, ...]
CheckKeys = Callable[[tuple[str, ...], dict[str, Any], str], None]
"""The converter's check of config.json rows by name (this kind's and every kind's), under a prefix."""


def draft_value(hparams: dict[str, Any], name: str, default: Any = None) -> Any:
    """z-lab's lookup order: `dflash_config` first, then the top level (both occur in published checkpoints)."""
    dflash_config = hparams.get("dflash_config") or {}
    if name in dflash_config:
        return dflash_config[name]
    return hparams.get(name, default)


class Converter:
    """The hooks; a kind with more to convert subclasses it."""

    def read_config(self, hparams: dict[str, Any], check: CheckKeys) -> tuple[dict[str, Any], bool | None, dict[str, Any]]:
        """(config.json brought to the DFlash schema, anchor-first block or None, values of this kind's own)."""
        return hparams, None, {}

    def complete(self, cfg: Any, tensors: dict[str, Any], directory: Any) -> dict[str, Any]:
        """`cfg.kind_values` completed from the checkpoint's tensors (GGUF name -> tensor with shape, file, name)."""
        return cfg.kind_values

    def shapes(self, cfg: Any) -> tuple[dict[str, Shape], dict[str, Shape]]:
        """(tensors of the whole drafter, tensors of each layer, `{bid}` names) only this kind has: HF shapes."""
        return {}, {}

    def optional_shapes(self, cfg: Any, name: str, shape: Shape) -> dict[str, Shape]:
        """Tensors this kind may hold, with their HF shapes; KindError for `name` of a shape no reader takes."""
        return {}

    def metadata(self, cfg: Any, tensor_names: set[str]) -> list[tuple[str, Any, gguf.GGUFValueType]]:
        """GGUF keys only this kind writes: (key, value, type)."""
        return []

    def info_rows(self, info: Any) -> list[tuple[str, str]]:
        """Lines `dflash-convert --info` adds for a drafter of this kind."""
        return []

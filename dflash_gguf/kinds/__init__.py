"""Drafter kinds: each one package (`dflash/`, `dflash2/`, `dspark/`) carrying its rows, its head (runtime),
its converter hooks and its training hooks (torch, loaded only when asked for); this module is the registry.

Adding a kind is a package beside these and one line below (`register`); nothing else in the project asks
which kind a drafter is: each reader takes the part it needs from the `DrafterKind` (`base.py`).
"""

from __future__ import annotations

from . import dflash, dflash2, dspark
from .base import (
    MAX_BLOCK_SIZE, MAX_LAYERS, ConfigKey, ConfigRule, DrafterKind, GGUFRule, Hparams, KindError, MetaKey, TensorSpec,
    all_kinds, architectures, kind_named, kind_names, kind_of_architecture, kind_of_file, register, unregister,
)

__all__ = [
    "MAX_BLOCK_SIZE", "MAX_LAYERS", "ConfigKey", "ConfigRule", "DFLASH", "DrafterKind", "GGUFRule", "Hparams", "KindError",
    "MetaKey", "TensorSpec", "all_kinds", "architectures", "kind_named", "kind_names", "kind_of_architecture",
    "kind_of_file", "register", "unregister",
]

# the registry, in the order --kind, --info and the TUI list them
DFLASH = register(dflash.KIND)
"""The base kind: every drafter GGUF without another kind's marker."""
register(dflash2.KIND)
register(dspark.KIND)

"""The server's settings: what the CLI parsed, handed to the app."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import GenerationConfig, _check_fields, setting
from ..prompt_cache import DEFAULT_DISK_BYTES, parse_size

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_MODEL_ALIAS = "dflash"


def _size(value: Any) -> int:
    """A byte count: an integer >= 0, or a size such as 512MiB / 2GiB."""
    if isinstance(value, str):
        return parse_size(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"must be a size such as 512MiB or 2GiB, or an integer >= 0, got {value!r}")
    return value


def _directory(value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise TypeError(f"must be None or a directory path, got {value!r}")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    return path


@dataclass(frozen=True)
class CacheOptions:
    """The prompt cache every slot shares (llama-server's --cache-ram; a disk tier that survives a restart)."""

    cache_ram: int = setting(0, _size, "RAM for the prompt cache, e.g. 2GiB (0: no RAM tier)", parse=str)
    cache_dir: Path | None = setting(None, _directory, "directory of the prompt cache's disk tier (kept across "
                                     "restarts; default: none)", parse=str)
    cache_disk: int = setting(DEFAULT_DISK_BYTES, _size, "disk budget of --cache-dir, e.g. 20GiB (default: 8GiB)",
                              parse=str)

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def enabled(self) -> bool:
        return self.cache_ram > 0 or self.cache_dir is not None


@dataclass(frozen=True)
class ServerConfig:
    """How the app behaves; the Sessions themselves are opened by the caller (the CLI or a test)."""

    model_alias: str = DEFAULT_MODEL_ALIAS
    api_key: str | None = None
    max_queue: int = 16  # requests that may wait for a slot; one more gets 429
    max_body_bytes: int = 1 << 20
    # the server's own generation settings (block_size from --block-size); each request's fields apply over them
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    accept_any_model: bool = False  # answer whatever `model` a client names (agents send their own names)
    created: int = 0  # the model's `created` in /v1/models

    def __post_init__(self) -> None:
        if not self.model_alias:
            raise ValueError("model_alias must be a non-empty string")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")

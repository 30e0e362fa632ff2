"""Torch-free reading of safetensors files, checked against the file before any data is used.

gguf-py's `SafetensorsLocal` parses the header; it trusts the offsets in it, so every
tensor's dtype, byte count and extent are checked here against the real file size:
a truncated or corrupt checkpoint fails with a clear message instead of short reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.utility import SafetensorsLocal

from dflash_gguf.convert.errors import ConversionError

# safetensors dtype -> (numpy storage dtype, element size). bf16 is stored as its uint16 bits.
_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


@dataclass(frozen=True)
class CheckpointTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    name: str
    dtype: str  # safetensors spelling: "BF16", "F32", ...
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    def read(self) -> np.ndarray:
        """The tensor as float32 (bf16/f16 widen exactly), or int64 for integer tensors such as `d2t`."""
        storage = _DTYPES[self.dtype]
        with open(self.file, "rb") as f:
            f.seek(self.offset)
            raw = f.read(self.nbytes)
        if len(raw) != self.nbytes:
            raise ConversionError(f"{self.file}: truncated while reading tensor {self.name}")
        data = np.frombuffer(raw, dtype=storage).reshape(self.shape)
        if self.dtype == "BF16":
            return (data.astype(np.uint32) << 16).view(np.float32)
        if data.dtype.kind in "iub":
            return data.astype(np.int64)
        return data.astype(np.float32)


def read_safetensors_index(path: Path) -> dict[str, CheckpointTensor]:
    """Every tensor in one safetensors file, validated against the file's size."""
    try:
        with SafetensorsLocal(path) as tensors:
            entries = dict(tensors)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, UnicodeDecodeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConversionError(f"{path}: corrupt safetensors header ({reason})") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None

    file_size = path.stat().st_size
    result: dict[str, CheckpointTensor] = {}
    for name, entry in entries.items():
        if entry.dtype not in _DTYPES:
            raise ConversionError(f"{path}: tensor {name} has unsupported dtype {entry.dtype}")
        if not all(isinstance(d, int) and d >= 0 for d in entry.shape):
            raise ConversionError(f"{path}: tensor {name} has an invalid shape {list(entry.shape)}")
        expected = math.prod(entry.shape) * _DTYPES[entry.dtype].itemsize
        offset, size = entry.data_range.offset, entry.data_range.size
        if size != expected:
            raise ConversionError(
                f"{path}: corrupt safetensors: tensor {name} spans {size} bytes, its shape needs {expected}"
            )
        if offset + size > file_size:
            raise ConversionError(
                f"{path}: truncated safetensors: tensor {name} ends at byte {offset + size}, file has {file_size}"
            )
        result[name] = CheckpointTensor(name, entry.dtype, tuple(entry.shape), path, offset, size)
    return result

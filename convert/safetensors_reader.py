"""Torch-free reading of safetensors files, every header entry checked before any data is used.

The header is parsed here, not by gguf-py's `SafetensorsLocal`, which trusts it: each
tensor's dtype, shape and `data_offsets` are checked against the file's data section
(exactly two integers, start >= 0, end <= the section's size, end - start = shape x dtype,
no two tensors overlapping, no name twice, together tiling the section as the format requires). A truncated, corrupt or crafted checkpoint fails
with one clear line instead of being written as weights. Only regular files are opened:
a FIFO or a device named as a checkpoint is refused, never read (reading one can block forever).
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

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

MAX_HEADER_BYTES = 100 * 2**20
"""The safetensors format's own cap on the JSON header (the reference library refuses more)."""

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def check_regular_file(path: Path, what: str = "file") -> os.stat_result:
    """os.stat (through symlinks) of a file that must be regular; ConversionError otherwise, never blocking."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConversionError(f"{path}: no such file") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConversionError(f"{path}: {what} is {_kind(st.st_mode)}, not a regular file")
    return st


def open_regular(path: Path, what: str = "file") -> BinaryIO:
    """Open a regular file for reading: checked by os.stat first, and again on the open descriptor.

    The open is non-blocking, so a FIFO swapped in between the two checks cannot hang it either.
    """
    check_regular_file(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConversionError(f"{path}: {what} is {_kind(st.st_mode)}, not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_text(path: Path, what: str = "file") -> str:
    """The UTF-8 text of a regular file (ConversionError for anything else)."""
    with open_regular(path, what) as f:
        data = f.read()
    return data.decode("utf-8")


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
        with open_regular(self.file, "safetensors file") as f:
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


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_header(path: Path, f: BinaryIO, file_size: int) -> tuple[dict[str, Any], int]:
    """(header JSON object, byte offset of the data section)."""
    prefix = f.read(8)
    if len(prefix) != 8:
        raise ConversionError(f"{path}: corrupt safetensors header (file of {file_size} bytes has no header length)")
    n = int.from_bytes(prefix, "little")
    if n > MAX_HEADER_BYTES:
        raise ConversionError(f"{path}: corrupt safetensors header (claims {n} header bytes, the format allows {MAX_HEADER_BYTES})")
    if 8 + n > file_size:
        raise ConversionError(f"{path}: corrupt safetensors header (needs {8 + n} bytes, file has {file_size})")
    raw = f.read(n)
    if len(raw) != n:
        raise ConversionError(f"{path}: truncated safetensors header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Duplicate as e:
        raise ConversionError(f"{path}: corrupt safetensors header (key {str(e)!r} appears twice)") from None
    except RecursionError:
        raise ConversionError(f"{path}: corrupt safetensors header (JSON nested too deeply)") from None
    except (UnicodeDecodeError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConversionError(f"{path}: corrupt safetensors header ({reason})") from None
    if not isinstance(header, dict):
        raise ConversionError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + n


def read_safetensors_index(path: Path) -> dict[str, CheckpointTensor]:
    """Every tensor in one safetensors file, each entry validated against the file's data section."""
    path = Path(path)
    with open_regular(path, "safetensors file") as f:
        file_size = os.fstat(f.fileno()).st_size
        header, data_start = _parse_header(path, f, file_size)
    data_size = file_size - data_start

    result: dict[str, CheckpointTensor] = {}
    extents: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
                raise ConversionError(f"{path}: corrupt safetensors header (__metadata__ must map names to strings)")
            continue
        if not isinstance(entry, dict):
            raise ConversionError(f"{path}: corrupt safetensors header (entry {name} is not an object)")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in _DTYPES:
            raise ConversionError(f"{path}: tensor {name} has unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise ConversionError(f"{path}: tensor {name} has an invalid shape {shape!r}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
            raise ConversionError(
                f"{path}: corrupt safetensors: tensor {name} data_offsets must be two integers, got {offsets!r}"
            )
        begin, end = offsets
        if begin < 0 or end < begin:
            raise ConversionError(f"{path}: corrupt safetensors: tensor {name} data_offsets {offsets} are not an extent")
        size = end - begin
        expected = math.prod(shape) * _DTYPES[dtype].itemsize
        if size != expected:
            raise ConversionError(
                f"{path}: corrupt safetensors: tensor {name} spans {size} bytes, its shape needs {expected}"
            )
        if end > data_size:
            raise ConversionError(
                f"{path}: truncated safetensors: tensor {name} ends at byte {data_start + end}, file has {file_size}"
            )
        if size:
            extents.append((begin, end, name))
        result[name] = CheckpointTensor(name, dtype, tuple(shape), path, data_start + begin, size)

    extents.sort()
    for (_, prev_end, prev_name), (begin, _, name) in zip(extents, extents[1:]):
        if begin < prev_end:
            raise ConversionError(f"{path}: corrupt safetensors: tensors {prev_name} and {name} overlap")
        if begin > prev_end:
            raise ConversionError(f"{path}: corrupt safetensors: {begin - prev_end} bytes between tensors {prev_name} and {name} belong to none")
    # the format's own rule (the safetensors library enforces it): the tensors tile the data section exactly.
    # A header length off by a few bytes shifts every offset and still parses; only this catches it.
    covered_from = extents[0][0] if extents else 0
    covered_to = extents[-1][1] if extents else 0
    if covered_from != 0 or covered_to != data_size:
        raise ConversionError(
            f"{path}: corrupt safetensors: the tensors cover bytes [{covered_from}, {covered_to}) "
            f"of a {data_size}-byte data section (the header length or the offsets are wrong)"
        )
    return dict(sorted(result.items()))

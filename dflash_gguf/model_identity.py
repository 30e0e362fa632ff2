"""A model file's identity for the prompt cache: cheap enough for a 20 GB file, and it sees the weights.

A GGUF's first MiB is metadata: two checkpoints of one fine-tune converted by one script, or a re-export
with fixed weights under the same name, share it. So the identity hashes the whole header (metadata and
tensor index, up to the data section) and three 4 KiB samples of every tensor's data (its start, middle
and end): a tensor that changed anywhere it is sampled, or moved, changes the identity, and so does any
change of a quantisation or a shape. The bytes read are the header plus 12 KiB per tensor (a few hundred
to a few thousand tensors: some MiB, whatever the file's size).

Samples cannot see every byte, so the file's size and mtime_ns are part of the identity too: a file
rewritten in place or replaced by a rename is a new identity even where no sample differs. The path and
the inode are not: a byte-identical copy whose mtime was kept (cp -p, rsync -a) shares the entries of its
original, which is what a copy should do; a copy with a new mtime is merely a miss.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from pathlib import Path

__all__ = ["file_identity", "identity_bytes_read"]

SAMPLE = 4096  # bytes hashed at each sampled place
FALLBACK_SAMPLES = 1024  # evenly spaced samples of a file whose tensor index cannot be read
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT (ggml/include/gguf.h)

# gguf_type (ggml/include/gguf.h): the byte size of each fixed-size value type
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")

# (path, dev, ino, size, mtime_ns, ctime_ns) -> (identity, bytes read): the ctime moves on every write and on
# every utime, so a file is hashed again whenever it may have changed, even under a mtime put back
_memo: dict[tuple[str, int, int, int, int, int], tuple[str, int]] = {}


def file_identity(path: str | os.PathLike[str] | None) -> str | None:
    """`SIZE:MTIME_NS:SHA256` of a model file (None for None): the header and samples of every tensor."""
    if path is None:
        return None
    return _identity(Path(path))[0]


def identity_bytes_read(path: str | os.PathLike[str]) -> int:
    """How many bytes of the file file_identity hashes (what its cost scales with)."""
    return _identity(Path(path))[1]


def _identity(path: Path) -> tuple[str, int]:
    st = path.stat()
    key = (str(path.resolve()), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _memo:
        digest = hashlib.sha256()
        n_read = 0
        if st.st_size:
            with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                for start, end in _regions(data):
                    digest.update(data[start:end])
                    n_read += end - start
        _memo[key] = f"{st.st_size}:{st.st_mtime_ns}:{digest.hexdigest()}", n_read
    return _memo[key]


def _regions(data: mmap.mmap) -> list[tuple[int, int]]:
    """The byte ranges hashed: the GGUF header whole, then SAMPLE bytes at the start, middle and end of
    each tensor's data; for a file that is not a readable GGUF, FALLBACK_SAMPLES evenly spaced ranges."""
    size = len(data)
    try:
        data_start, offsets = _tensor_index(data)
    except (ValueError, struct.error):
        step = max(size // FALLBACK_SAMPLES, 1)
        return _merge([(o, min(o + SAMPLE, size)) for o in range(0, size, step)])
    bounds = sorted({data_start + o for o in offsets if data_start + o < size}) + [size]
    regions = [(0, data_start)]
    for start, end in zip(bounds, bounds[1:]):
        for at in (start, (start + end - SAMPLE) // 2, end - SAMPLE):
            regions.append((max(at, start), min(max(at, start) + SAMPLE, end)))
    return _merge(regions)


def _merge(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping ranges joined, so that no byte is hashed twice."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(regions):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def _tensor_index(data: mmap.mmap) -> tuple[int, list[int]]:
    """(offset of the data section, each tensor's offset in it), walking the GGUF header (gguf.h's layout,
    version 2 and 3) without building its values: a 150k-token vocabulary is a loop over string lengths."""
    size = len(data)
    if data[:4] != b"GGUF" or _U32.unpack_from(data, 4)[0] not in (2, 3):
        raise ValueError("not a GGUF of version 2 or 3")
    n_tensors, n_kv = _U64.unpack_from(data, 8)[0], _U64.unpack_from(data, 16)[0]
    pos = 24
    alignment = DEFAULT_ALIGNMENT

    def string(at: int) -> int:  # the position after a string at `at`
        end = at + 8 + _U64.unpack_from(data, at)[0]
        if end > size:
            raise ValueError("a string runs past the end of the file")
        return end

    def value(at: int, kind: int) -> int:  # the position after a value of type `kind` at `at`
        if kind in _FIXED:
            return at + _FIXED[kind]
        if kind == _STRING:
            return string(at)
        if kind != _ARRAY:
            raise ValueError(f"unknown value type {kind}")
        inner, count = _U32.unpack_from(data, at)[0], _U64.unpack_from(data, at + 4)[0]
        at += 12
        if inner in _FIXED:
            return at + count * _FIXED[inner]
        if count * 8 > size - at:
            raise ValueError("an array longer than the file")
        for _ in range(count):
            at = value(at, inner)
        return at

    for _ in range(n_kv):
        key_end = string(pos)
        kind = _U32.unpack_from(data, key_end)[0]
        if data[pos + 8 : key_end] == b"general.alignment" and kind == _UINT32:
            alignment = _U32.unpack_from(data, key_end + 4)[0] or DEFAULT_ALIGNMENT
        pos = value(key_end + 4, kind)
    if n_tensors * 24 > size - pos:
        raise ValueError("more tensors than the file has room for")
    offsets = []
    for _ in range(n_tensors):
        pos = string(pos)
        n_dims = _U32.unpack_from(data, pos)[0]
        pos += 4 + 8 * n_dims + 4  # dims, type
        offsets.append(_U64.unpack_from(data, pos)[0])
        pos += 8
    data_start = -(-pos // alignment) * alignment
    if data_start > size:
        raise ValueError("the tensor index runs past the end of the file")
    return data_start, offsets

"""A prompt-cache entry never restores into another model (issue 35, probe item 1).

The model file's identity (dflash_gguf.model_identity.file_identity) must see the weights: a copy of the
embedded target with ffn_down tensors swapped has the same size and the same first MiB (all metadata), and
is built here with gguf-py's reader locating the tensors.
"""

from __future__ import annotations

import os
import shutil

import pytest

from dflash_gguf import Session
from dflash_gguf.defaults import embedded_drafter
from dflash_gguf.model_identity import SAMPLE, file_identity, identity_bytes_read
from dflash_gguf.prompt_cache import PromptCache
from dflash_gguf.target_gguf import open_gguf

SWAPS = [("blk.3.ffn_down.weight", "blk.17.ffn_down.weight"), ("blk.8.ffn_down.weight", "blk.25.ffn_down.weight")]


def swapped_bytes(path) -> list[tuple[int, bytes]]:
    """(offset, bytes) writes that swap the data of the SWAPS pairs (same type and shape) in a copy of path."""
    tensors = {t.name: t for t in open_gguf(path).tensors}
    writes = []
    for a, b in SWAPS:
        ta, tb = tensors[a], tensors[b]
        assert ta.n_bytes == tb.n_bytes and ta.tensor_type == tb.tensor_type
        writes += [(int(ta.data_offset), bytes(tb.data.tobytes())), (int(tb.data_offset), bytes(ta.data.tobytes()))]
    return writes


def write_at(path, writes) -> None:
    """Rewrite parts of the file in place (same inode)."""
    with open(path, "r+b") as f:
        for offset, data in writes:
            f.seek(offset)
            f.write(data)


@pytest.fixture(scope="module")
def swaps(embedded_target):
    return swapped_bytes(embedded_target)


@pytest.fixture
def swapped(embedded_target, swaps, tmp_path):
    """A copy of the target with tensors swapped, its mtime set to the original's: only the weights differ."""
    path = tmp_path / "swapped.gguf"
    shutil.copyfile(embedded_target, path)
    write_at(path, swaps)
    st = os.stat(embedded_target)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return path


def test_swapped_weights_are_another_identity(embedded_target, swapped):
    with open(embedded_target, "rb") as a, open(swapped, "rb") as b:
        assert a.read(1 << 20) == b.read(1 << 20)  # what the old identity hashed
    assert os.path.getsize(swapped) == os.path.getsize(embedded_target)
    assert os.stat(swapped).st_mtime_ns == os.stat(embedded_target).st_mtime_ns
    assert file_identity(swapped) != file_identity(embedded_target)


def test_a_byte_identical_copy_that_kept_its_mtime_shares_the_identity(embedded_target, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copy2(embedded_target, copy)  # as cp -p: bytes and mtime
    assert file_identity(copy) == file_identity(embedded_target)


def test_an_in_place_rewrite_is_another_identity(embedded_target, swaps, tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy2(embedded_target, path)
    before, st = file_identity(path), os.stat(path)
    write_at(path, swaps)  # same path, same inode, new weights
    assert os.stat(path).st_ino == st.st_ino
    assert file_identity(path) != before
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its old mtime put back: the samples see it
    assert file_identity(path) != before
    with open(embedded_target, "rb") as f:
        original = [(o, (f.seek(o), f.read(len(d)))[1]) for o, d in swaps]
    write_at(path, original)  # the original bytes again, but written now
    assert file_identity(path) != before
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_identity(path) == before


def test_what_it_reads_is_the_header_and_three_samples_a_tensor(embedded_target):
    reader = open_gguf(embedded_target)
    assert identity_bytes_read(embedded_target) <= reader.data_offset + 3 * SAMPLE * len(reader.tensors)
    assert identity_bytes_read(embedded_target) < os.path.getsize(embedded_target) // 10


def test_a_file_that_is_not_a_gguf_is_sampled_evenly(tmp_path):
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(8 << 20))
    st = os.stat(path)
    before = file_identity(path)
    write_at(path, [(4 << 20, b"x" * SAMPLE)])  # 4 MiB is a sampled place (every size/1024 bytes)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert file_identity(path) != before
    assert identity_bytes_read(path) == 1024 * SAMPLE


@pytest.mark.slow  # three Sessions of the embedded pair
def test_an_entry_of_the_original_never_restores_into_the_swapped_copy(embedded_target, swapped, tmp_path):
    cache_dir = tmp_path / "cache"
    prompt = "The report lists the inventory of the forest station: " * 6

    def run(target):
        with Session(target, embedded_drafter(), prompt_cache=PromptCache(directory=cache_dir), n_ctx=512,
                     n_threads=1) as s:
            return s.generate(prompt, block_size=4, max_tokens=4).stats.prompt_cache

    assert run(embedded_target).stored
    assert run(swapped).tier is None  # a miss: the entry is another model's
    assert run(embedded_target).tier == "disk"  # the original still hits

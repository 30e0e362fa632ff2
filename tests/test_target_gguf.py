"""read_target_info and the target fingerprint, on the embedded target and a real requantization of it."""

from __future__ import annotations

from pathlib import Path

import gguf
import llama_cpp
import pytest

from checkpoints import token_fields, write_metadata_gguf
from dflash_gguf.target_gguf import FastGGUFReader, field_value, fingerprint, read_target_info


@pytest.fixture(scope="module")
def requantized_target(embedded_target, tmp_path_factory) -> Path:
    """The embedded Q4_1 target requantized to Q4_0 by libllama's own quantizer."""
    out = tmp_path_factory.mktemp("requant") / "smollm2.Q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(embedded_target).encode(), str(out).encode(), params) == 0
    return out


@pytest.fixture(scope="module")
def info(embedded_target):
    return read_target_info(embedded_target)


def test_geometry_of_the_embedded_target(info, embedded_target):
    assert info.path == embedded_target
    assert (info.architecture, info.n_embd, info.n_layer, info.n_vocab) == ("llama", 576, 30, 49152)
    assert not info.recurrent and not info.mrope
    keys = {f.key for f in info.tokenizer_fields}
    assert {"tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"} <= keys
    assert all(k.startswith("tokenizer.") for k in keys)


def test_fingerprint_survives_requantization(info, requantized_target, embedded_target):
    requant = read_target_info(requantized_target)
    assert requantized_target.read_bytes() != embedded_target.read_bytes()
    assert field_value(FastGGUFReader(requantized_target), "general.file_type") != field_value(
        FastGGUFReader(embedded_target), "general.file_type"
    )
    assert requant.fingerprint == info.fingerprint


def test_fingerprint_depends_on_shape_and_every_token(info, embedded_target):
    tokens = field_value(FastGGUFReader(embedded_target), "tokenizer.ggml.tokens")
    assert fingerprint("llama", 576, 30, tokens) == info.fingerprint
    assert len(info.fingerprint) == 16 and int(info.fingerprint, 16) >= 0
    changed = list(tokens)
    changed[30000] = changed[30000] + "x"
    assert fingerprint("llama", 576, 30, changed) != info.fingerprint
    assert fingerprint("llama", 576, 29, tokens) != info.fingerprint
    assert fingerprint("llama", 640, 30, tokens) != info.fingerprint
    assert fingerprint("qwen3", 576, 30, tokens) != info.fingerprint


def test_fast_reader_reads_what_gguf_reader_reads(embedded_target):
    fast, plain = FastGGUFReader(embedded_target), gguf.GGUFReader(embedded_target)
    assert list(fast.fields) == list(plain.fields)
    for key in plain.fields:
        assert fast.fields[key].contents() == plain.fields[key].contents(), key
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in fast.tensors] == [
        (t.name, t.tensor_type, list(t.shape), t.data_offset) for t in plain.tensors
    ]
    assert (fast.tensors[0].data == plain.tensors[0].data).all()


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_target_info(tmp_path / "absent.gguf")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.gguf: not a GGUF file"):
        read_target_info(path)


@pytest.mark.parametrize("size", [6, 100, 1 << 20, 3 << 20])
def test_truncated_gguf(tmp_path, embedded_target, size):
    path = tmp_path / "cut.gguf"
    with open(embedded_target, "rb") as f:
        path.write_bytes(f.read(size))
    with pytest.raises(ValueError, match=r"cut\.gguf: truncated or corrupt GGUF"):
        read_target_info(path)


def test_gguf_without_tokenizer(tmp_path):
    path = write_metadata_gguf(tmp_path / "bare.gguf", "llama", n_embd=576, n_layer=30)
    with pytest.raises(ValueError, match=r"bare\.gguf: the target GGUF has no tokenizer"):
        read_target_info(path)


def test_recurrent_architecture_is_flagged(tmp_path):
    path = write_metadata_gguf(tmp_path / "mamba.gguf", "mamba", n_embd=768, n_layer=24, fields=token_fields(["a", "b"]))
    assert read_target_info(path).recurrent

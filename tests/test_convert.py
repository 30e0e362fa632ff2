"""dflash-convert on real reference checkpoints: libllama loads the result, every value round-trips."""

from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import gguf
import llama_cpp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from checkpoints import DFLASH2_CONFIG, MASK_TOKEN_ID, TARGET_LAYER_IDS, VOCAB_SIZE
from dflash_gguf import llama_ext
from dflash_gguf.convert import convert_checkpoint
from dflash_gguf.schema import ARCH, Keys, Tensors, gguf_tensor_name
from dflash_gguf.target_gguf import field_value, read_target_info

GGUF_LAYERS = [i + 1 for i in TARGET_LAYER_IDS]


@contextmanager
def loaded_model(path: Path) -> Iterator[llama_cpp.llama_model_p]:
    """The GGUF loaded by the bundled libllama (CPU only); fails the test if it does not load."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"libllama could not load {path}"
    try:
        yield model
    finally:
        llama_cpp.llama_model_free(model)


def meta(model, key: str) -> str:
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    assert n >= 0, f"libllama reports no {key}"
    return buf.value.decode()


def checkpoint_tensors(directory: Path) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values, read with the safetensors library (an independent reader)."""
    values: dict[str, np.ndarray] = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            values[gguf_tensor_name(name)] = tensor.to(torch.float32).numpy()
    return values


@functools.lru_cache(maxsize=8)
def reader(path: Path) -> gguf.GGUFReader:
    """Parsing a GGUF with a 49k-token vocabulary takes seconds: parse each file once."""
    return gguf.GGUFReader(path)


def gguf_tensors(path: Path) -> dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]]:
    return {
        t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        for t in reader(path).tensors
    }


def assert_round_trip(ckpt_dir: Path, gguf_path: Path, outtype: str | None) -> None:
    expected = checkpoint_tensors(ckpt_dir)
    written = gguf_tensors(gguf_path)
    assert set(written) == set(expected)
    Q = gguf.GGMLQuantizationType
    for name, want in expected.items():
        qtype, got = written[name]
        assert got.shape == want.shape, name
        if want.ndim == 1 or not name.endswith(".weight"):
            assert qtype == Q.F32, name
        if qtype in (Q.F32, Q.BF16):
            # the checkpoint is bf16: f32 and bf16 hold it exactly
            np.testing.assert_array_equal(got, want, err_msg=name)
        elif qtype == Q.F16:
            np.testing.assert_allclose(got, want, rtol=2**-10, atol=2**-24, err_msg=name)
        else:
            assert qtype == Q.Q8_0, name
            # q8_0: per block of 32, half a step of max|x|/127, plus the f16 rounding of the block scale
            peak = np.abs(want).reshape(-1, 32).max(axis=1, keepdims=True)
            err = np.abs(got - want).reshape(-1, 32)
            assert (err <= peak / 127 * 0.5 + peak * 2**-10).all(), name


def test_dflash_gguf_loads_in_libllama(dflash_gguf_path):
    with loaded_model(dflash_gguf_path) as model:
        assert meta(model, Keys.ARCHITECTURE) == ARCH
        assert llama_ext.target_layer_ids(model) == GGUF_LAYERS
        assert llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)) == VOCAB_SIZE
        assert meta(model, Keys.MASK_TOKEN_ID) == str(MASK_TOKEN_ID)
        assert llama_ext.model_dflash_selector_top_k(model) <= 0


def test_dflash2_gguf_loads_in_libllama_with_its_selector(dflash2_gguf_path):
    with loaded_model(dflash2_gguf_path) as model:
        assert meta(model, Keys.ARCHITECTURE) == ARCH
        assert llama_ext.target_layer_ids(model) == GGUF_LAYERS
        assert llama_ext.model_dflash_selector_top_k(model) == DFLASH2_CONFIG["selector_top_k"]


def test_every_dflash_tensor_round_trips(reference_checkpoint, dflash_gguf_path):
    assert_round_trip(reference_checkpoint, dflash_gguf_path, None)


def test_every_dflash2_tensor_round_trips(reference_checkpoint_dflash2, dflash2_gguf_path):
    assert_round_trip(reference_checkpoint_dflash2, dflash2_gguf_path, None)


def test_default_outtype_keeps_bf16_matrices(dflash_gguf_path):
    written = gguf_tensors(dflash_gguf_path)
    assert written[Tensors.FC][0] == gguf.GGMLQuantizationType.BF16
    assert written[Tensors.ATTN_Q.format(bid=0)][0] == gguf.GGMLQuantizationType.BF16
    assert written[Tensors.OUTPUT_NORM][0] == gguf.GGMLQuantizationType.F32


def test_target_tokenizer_and_fingerprint_are_recorded(dflash_gguf_path, embedded_target):
    target = read_target_info(embedded_target)
    drafter = reader(dflash_gguf_path)
    assert field_value(drafter, Keys.TARGET_FINGERPRINT) == target.fingerprint
    assert field_value(drafter, Keys.TARGET_N_LAYER) == 30
    assert field_value(drafter, Keys.TARGET_N_EMBD) == 576
    assert field_value(drafter, Keys.TARGET_N_VOCAB) == VOCAB_SIZE
    target_reader = reader(embedded_target)
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template"):
        assert field_value(drafter, key) == field_value(target_reader, key), key
    assert field_value(drafter, Keys.BLOCK_SIZE) == 16
    assert field_value(drafter, Keys.TARGET_LAYERS) == GGUF_LAYERS


def test_dflash2_keys_are_written_as_upstream_reads_them(dflash2_gguf_path):
    drafter = reader(dflash2_gguf_path)
    assert field_value(drafter, "dflash.conv_kernel_size") == DFLASH2_CONFIG["conv_kernel_size"]
    assert field_value(drafter, "dflash.conv_group_size") == DFLASH2_CONFIG["conv_group_size"]
    assert field_value(drafter, "dflash.selector_rank") == DFLASH2_CONFIG["selector_rank"]
    assert field_value(drafter, "dflash.selector_top_k") == DFLASH2_CONFIG["selector_top_k"]
    names = {t.name for t in drafter.tensors}
    # upstream: conv bases have no `.weight` suffix, selector codebooks do
    assert {"blk.0.attn_conv_base", "blk.0.ffn_conv_base", "selector_predecessor.weight",
            "selector_successor.weight", "selector_hidden.weight"} <= names


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_outtypes_round_trip_and_load(reference_checkpoint_dflash2, tmp_path, outtype):
    out = convert_checkpoint(reference_checkpoint_dflash2, tmp_path / f"d.{outtype}.gguf", outtype=outtype, progress=False)
    assert_round_trip(reference_checkpoint_dflash2, out, outtype)
    written = gguf_tensors(out)
    expected_type = gguf.GGMLQuantizationType[outtype.upper()]
    assert written[Tensors.FC][0] == expected_type
    assert written[Tensors.OUTPUT_NORM][0] == gguf.GGMLQuantizationType.F32
    assert written["blk.0.attn_conv_base"][0] == gguf.GGMLQuantizationType.F32
    with loaded_model(out) as model:
        assert llama_ext.target_layer_ids(model) == GGUF_LAYERS

"""dflash-convert on real reference checkpoints: libllama loads the result, every value round-trips."""

from __future__ import annotations

import gguf
import llama_cpp
import pytest

from checkpoints import (
    DFLASH2_CONFIG, GGUF_LAYERS, MASK_TOKEN_ID, VOCAB_SIZE,
    assert_round_trip, gguf_tensors, loaded_model, meta, reader,
)
from dflash_gguf import llama_ext
from dflash_gguf.convert import convert_checkpoint
from dflash_gguf.schema import ARCH, Keys, Tensors
from dflash_gguf.target_gguf import field_value, read_target_info


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
    assert_round_trip(reference_checkpoint, dflash_gguf_path)


def test_every_dflash2_tensor_round_trips(reference_checkpoint_dflash2, dflash2_gguf_path):
    assert_round_trip(reference_checkpoint_dflash2, dflash2_gguf_path)


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
    assert_round_trip(reference_checkpoint_dflash2, out)
    written = gguf_tensors(out)
    expected_type = gguf.GGMLQuantizationType[outtype.upper()]
    assert written[Tensors.FC][0] == expected_type
    assert written[Tensors.OUTPUT_NORM][0] == gguf.GGMLQuantizationType.F32
    assert written["blk.0.attn_conv_base"][0] == gguf.GGMLQuantizationType.F32
    with loaded_model(out) as model:
        assert llama_ext.target_layer_ids(model) == GGUF_LAYERS


def test_progress_bar_reports_the_whole_conversion(capsys, reference_checkpoint, tmp_path):
    convert_checkpoint(reference_checkpoint, tmp_path / "bar.gguf", progress=True)
    err = capsys.readouterr().err
    assert "bar.gguf" in err and "100%" in err


def test_no_progress_is_silent(capsys, reference_checkpoint, tmp_path):
    convert_checkpoint(reference_checkpoint, tmp_path / "quiet.gguf", progress=False)
    assert capsys.readouterr().err == ""


def test_general_name_is_the_output_stem_unless_given(reference_checkpoint, dflash_gguf_path, tmp_path):
    assert field_value(reader(dflash_gguf_path), Keys.NAME) == dflash_gguf_path.stem
    named = convert_checkpoint(reference_checkpoint, tmp_path / "x.gguf", name="Tiny-DFlash", progress=False)
    assert field_value(reader(named), Keys.NAME) == "Tiny-DFlash"

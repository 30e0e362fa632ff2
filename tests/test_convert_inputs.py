"""The input forms and config variants dflash-convert accepts, and what it writes for each."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import (
    GGUF_LAYERS, HEAD_DIM, HIDDEN_SIZE, MASK_TOKEN_ID, VOCAB_SIZE, assert_round_trip, checkpoint_tensors,
    gguf_tensors, loaded_model, make_reference_checkpoint, meta, reader, write_metadata_gguf,
)
from dflash_gguf import llama_ext
from dflash_gguf.convert import convert_checkpoint
from dflash_gguf.convert.cli import main
from dflash_gguf.schema import Keys
from dflash_gguf.target_gguf import MetadataField, field_value, read_target_info


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory) -> Path:
    """A DFlash2 checkpoint saved in ~4 MB shards with a model.safetensors.index.json."""
    d = make_reference_checkpoint(tmp_path_factory.mktemp("sharded"), kind="dflash2", seed=3, max_shard_size="4MB")
    assert (d / "model.safetensors.index.json").is_file()
    assert len(list(d.glob("model-*.safetensors"))) > 1
    return d


def edited_copy(ckpt: Path, dest: Path, edit) -> Path:
    shutil.copytree(ckpt, dest)
    config = json.loads((dest / "config.json").read_text())
    edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_sharded_checkpoint_by_directory(sharded_checkpoint, tmp_path):
    out = convert_checkpoint(sharded_checkpoint, tmp_path / "d.gguf", progress=False)
    assert_round_trip(sharded_checkpoint, out)
    with loaded_model(out) as model:
        assert llama_ext.target_layer_ids(model) == GGUF_LAYERS


def test_sharded_checkpoint_by_index_file(sharded_checkpoint, tmp_path):
    out = convert_checkpoint(sharded_checkpoint / "model.safetensors.index.json", tmp_path / "d.gguf", progress=False)
    assert_round_trip(sharded_checkpoint, out)


def test_single_file_argument(reference_checkpoint, tmp_path):
    out = convert_checkpoint(reference_checkpoint / "model.safetensors", tmp_path / "d.gguf", progress=False)
    assert_round_trip(reference_checkpoint, out)


def test_block_size_at_the_top_level(reference_checkpoint, tmp_path):
    def move(config):
        del config["dflash_config"]["block_size"]
        config["block_size"] = 8

    ckpt = edited_copy(reference_checkpoint, tmp_path / "ckpt", move)
    out = convert_checkpoint(ckpt, tmp_path / "d.gguf", progress=False)
    assert field_value(reader(out), Keys.BLOCK_SIZE) == 8
    with loaded_model(out) as model:
        assert meta(model, Keys.BLOCK_SIZE) == "8"


def test_block_size_defaults_to_upstreams(reference_checkpoint, tmp_path):
    ckpt = edited_copy(reference_checkpoint, tmp_path / "ckpt", lambda c: c["dflash_config"].pop("block_size"))
    out = convert_checkpoint(ckpt, tmp_path / "d.gguf", progress=False)
    assert field_value(reader(out), Keys.BLOCK_SIZE) == 16


def test_target_layers_derived_from_num_target_layers_as_the_reference_does(tmp_path):
    from dflash.model import build_target_layer_ids

    ckpt = make_reference_checkpoint(tmp_path / "ckpt", num_layers=2, target_layer_ids=None)
    out = convert_checkpoint(ckpt, tmp_path / "d.gguf", progress=False)
    expected = [i + 1 for i in build_target_layer_ids(30, 2)]
    with loaded_model(out) as model:
        assert llama_ext.target_layer_ids(model) == expected


def test_optional_scale_window_and_causal_keys(reference_checkpoint, tmp_path):
    def add(config):
        config["dflash_config"].update(
            output_multiplier=0.5, final_logit_softcapping=30.0, input_embedding_scale=2.0,
            attention_value_scale=0.25, use_swa=True, swa_window_size=64, causal=True,
        )

    ckpt = edited_copy(reference_checkpoint, tmp_path / "ckpt", add)
    out = convert_checkpoint(ckpt, tmp_path / "d.gguf", progress=False)
    r = reader(out)
    assert field_value(r, Keys.LOGIT_SCALE) == pytest.approx(0.5)
    assert field_value(r, Keys.FINAL_LOGIT_SOFTCAPPING) == pytest.approx(30.0)
    assert field_value(r, Keys.EMBEDDING_SCALE) == pytest.approx(2.0)
    assert field_value(r, Keys.VALUE_SCALE) == pytest.approx(0.25)
    assert field_value(r, Keys.SLIDING_WINDOW) == 64
    assert field_value(r, Keys.SLIDING_WINDOW_PATTERN) == [True]
    assert field_value(r, Keys.CAUSAL) is True
    with loaded_model(out) as model:
        assert meta(model, Keys.SLIDING_WINDOW) == "64"
        assert meta(model, Keys.CAUSAL) == "true"


def test_top_level_is_causal_and_absent_optional_keys(reference_checkpoint, tmp_path):
    ckpt = edited_copy(reference_checkpoint, tmp_path / "ckpt", lambda c: c.update(is_causal=False))
    out = convert_checkpoint(ckpt, tmp_path / "d.gguf", progress=False)
    r = reader(out)
    assert field_value(r, Keys.CAUSAL) is False
    for key in (Keys.LOGIT_SCALE, Keys.FINAL_LOGIT_SOFTCAPPING, Keys.EMBEDDING_SCALE, Keys.SLIDING_WINDOW):
        assert field_value(r, key) is None, key


def test_without_target_the_drafter_loads_and_the_cli_says_what_to_pass(capsys, reference_checkpoint, tmp_path):
    out = tmp_path / "bare.gguf"
    assert main([str(reference_checkpoint), str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target TARGET.gguf" in err[0]
    r = reader(out)
    assert field_value(r, Keys.TARGET_FINGERPRINT) is None
    assert field_value(r, Keys.MASK_TOKEN_ID) == MASK_TOKEN_ID
    with loaded_model(out) as model:
        assert meta(model, Keys.ARCHITECTURE) == "dflash"
        assert llama_ext.target_layer_ids(model) == GGUF_LAYERS
        vocab = llama_cpp.llama_model_get_vocab(model)
        # sized for the target's logits, but with no token texts: upstream's llama_vocab_mask()
        # cannot find the mask token, hence the note; the mask id is in the metadata
        assert llama_cpp.llama_vocab_n_tokens(vocab) == VOCAB_SIZE
        assert llama_cpp.llama_vocab_mask(vocab) == -1
        assert meta(model, Keys.MASK_TOKEN_ID) == str(MASK_TOKEN_ID)


def test_with_target_the_pair_passes_upstreams_vocabulary_checks(dflash_gguf_path, embedded_target):
    # the checks of common_speculative_are_compatible(), plus the mask token upstream's DFlash reads
    with loaded_model(dflash_gguf_path) as drafter, loaded_model(embedded_target) as target:
        vd, vt = llama_cpp.llama_model_get_vocab(drafter), llama_cpp.llama_model_get_vocab(target)
        assert llama_cpp.llama_vocab_type(vd) == llama_cpp.llama_vocab_type(vt)
        assert llama_cpp.llama_vocab_get_add_bos(vd) == llama_cpp.llama_vocab_get_add_bos(vt)
        assert llama_cpp.llama_vocab_bos(vd) == llama_cpp.llama_vocab_bos(vt)
        assert llama_cpp.llama_vocab_eos(vd) == llama_cpp.llama_vocab_eos(vt)
        n = llama_cpp.llama_vocab_n_tokens(vt)
        assert llama_cpp.llama_vocab_n_tokens(vd) == n
        assert all(llama_cpp.llama_vocab_get_text(vd, i) == llama_cpp.llama_vocab_get_text(vt, i) for i in range(n))
        assert llama_cpp.llama_vocab_mask(vd) == MASK_TOKEN_ID


def test_info_prints_what_the_drafter_holds(capsys, dflash2_gguf_path, embedded_target):
    assert main(["--info", str(dflash2_gguf_path)]) == 0
    text = capsys.readouterr().out
    lines = dict(line.split(":", 1) for line in text.strip().splitlines())
    lines = {k.strip(): v.strip() for k, v in lines.items()}
    assert lines["architecture"] == "dflash (DFlash2)"
    assert lines["block size"] == "16"
    assert lines["target layers"].startswith(str(GGUF_LAYERS))
    assert lines["mask token id"] == str(MASK_TOKEN_ID)
    assert "BF16" in lines["tensor types"] and "F32" in lines["tensor types"]
    assert f"{dflash2_gguf_path.stat().st_size:,} bytes" in lines["size"]
    assert lines["target fingerprint"].startswith(read_target_info(embedded_target).fingerprint)
    assert lines["tokenizer"] == f"{VOCAB_SIZE} tokens"


def test_interleaved_rope_checkpoints_are_permuted_to_neox_order(reference_checkpoint, tmp_path):
    ckpt = edited_copy(reference_checkpoint, tmp_path / "ckpt", lambda c: c.update(rope_is_neox_style=False))
    out = convert_checkpoint(ckpt, tmp_path / "d.gguf", progress=False)
    source = checkpoint_tensors(reference_checkpoint)
    written = gguf_tensors(out)
    # per head: even rotary dims first, then odd ones
    order = np.concatenate([np.arange(0, HEAD_DIM, 2), np.arange(1, HEAD_DIM, 2)])
    q = source["blk.0.attn_q.weight"].reshape(-1, HEAD_DIM, HIDDEN_SIZE)
    np.testing.assert_array_equal(written["blk.0.attn_q.weight"][1].reshape(q.shape), q[:, order])
    np.testing.assert_array_equal(written["blk.0.attn_k_norm.weight"][1], source["blk.0.attn_k_norm.weight"][order])
    np.testing.assert_array_equal(written["blk.0.attn_v.weight"][1], source["blk.0.attn_v.weight"])


@pytest.mark.slow  # writes an M-RoPE target GGUF and converts against it
def test_mrope_target_gets_degenerate_rope_sections(reference_checkpoint, embedded_target, tmp_path):
    # the embedded target's geometry and tokenizer, re-labelled as an M-RoPE HunYuan-VL (a transformer whose layer inputs libllama records)
    sections = MetadataField("hunyuan_vl.rope.dimension_sections", [16, 24, 24, 0], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    target = write_metadata_gguf(
        tmp_path / "mrope_target.gguf", "hunyuan_vl", n_embd=576, n_layer=30,
        fields=(sections, *read_target_info(embedded_target).tokenizer_fields),
    )
    out = convert_checkpoint(reference_checkpoint, tmp_path / "d.gguf", target=target, progress=False)
    assert field_value(reader(out), Keys.ROPE_DIMENSION_SECTIONS) == [HEAD_DIM // 2, 0, 0, 0]
    with loaded_model(out) as model:
        assert meta(model, Keys.ARCHITECTURE) == "dflash"


@pytest.mark.slow  # a checkpoint with its own 49k-row head, converted
def test_own_full_vocabulary_head_is_kept(reference_checkpoint, tmp_path):
    dest = Path(shutil.copytree(reference_checkpoint, tmp_path / "ckpt"))
    tensors = load_file(dest / "model.safetensors")
    tensors["lm_head.weight"] = (torch.randn(VOCAB_SIZE, HIDDEN_SIZE, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    out = convert_checkpoint(dest, tmp_path / "d.gguf", progress=False)
    assert_round_trip(dest, out)
    with loaded_model(out) as model:
        assert llama_ext.target_layer_ids(model) == GGUF_LAYERS


@pytest.mark.slow  # dflash-convert in a fresh process with torch blocked
def test_cli_end_to_end_without_torch(reference_checkpoint_dflash2, embedded_target, tmp_path):
    out = tmp_path / "cli.gguf"
    script = (
        "import sys\n"
        "from dflash_gguf.convert.cli import main\n"
        "code = main(sys.argv[1:])\n"
        "assert 'torch' not in sys.modules, 'the converter imported torch'\n"
        "sys.exit(code)\n"
    )
    args = [str(reference_checkpoint_dflash2), str(out), "--target", str(embedded_target), "--outtype", "q8_0"]
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}") and done.stderr == ""
    info = subprocess.run([sys.executable, "-m", "dflash_gguf.convert", "--info", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert info.returncode == 0, info.stderr
    assert "dflash (DFlash2)" in info.stdout and "Q8_0" in info.stdout
    assert read_target_info(embedded_target).fingerprint in info.stdout

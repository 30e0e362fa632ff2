"""Every bad input to dflash-convert: one line on stderr naming the problem and the file, exit 2, no output."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import HIDDEN_SIZE, NUM_TARGET_LAYERS, make_reference_checkpoint, token_fields, write_metadata_gguf
from dflash_gguf.convert.cli import main
from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.convert.writer import atomic_output


def run_cli(capsys, *args: str | Path) -> tuple[int, str]:
    try:
        code = main([str(a) for a in args])
    except SystemExit as e:  # argparse usage errors exit, as a console script does
        code = e.code
    captured = capsys.readouterr()
    return code, captured.err


def assert_bad_input(capsys, out: Path, *args: str | Path, mentions: tuple[str, ...]) -> str:
    """Exit code 2, exactly one stderr line naming the problem and file, no traceback, nothing written."""
    code, err = run_cli(capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for word in mentions:
        assert word in lines[0], (word, lines[0])
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.*")), "a temp file was left behind"
    return lines[0]


@pytest.fixture()
def ckpt(reference_checkpoint, tmp_path) -> Path:
    """A private copy of the reference checkpoint to damage."""
    return Path(shutil.copytree(reference_checkpoint, tmp_path / "ckpt"))


@pytest.fixture()
def out(tmp_path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d / "drafter.gguf"


def edit_config(ckpt: Path, **changes) -> None:
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_tensors(ckpt: Path, edit) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def write_target(
    path: Path, *, arch: str = "llama", n_embd: int = HIDDEN_SIZE, n_layer: int = NUM_TARGET_LAYERS, n_vocab: int = 49152
) -> Path:
    """A metadata-only target GGUF with chosen geometry."""
    return write_metadata_gguf(path, arch, n_embd=n_embd, n_layer=n_layer, fields=token_fields([f"t{i}" for i in range(n_vocab)]))


def test_missing_input_path(capsys, tmp_path, out):
    assert_bad_input(capsys, out, tmp_path / "nowhere", out, mentions=("nowhere", "no such file"))


def test_missing_config_json(capsys, ckpt, out):
    (ckpt / "config.json").unlink()
    assert_bad_input(capsys, out, ckpt / "model.safetensors", out, mentions=("config.json", "missing"))


def test_invalid_config_json(capsys, ckpt, out):
    (ckpt / "config.json").write_text("{ not json")
    assert_bad_input(capsys, out, ckpt, out, mentions=("config.json", "invalid"))


def test_config_without_mask_token_id(capsys, ckpt, out):
    config = json.loads((ckpt / "config.json").read_text())
    del config["dflash_config"]["mask_token_id"]
    (ckpt / "config.json").write_text(json.dumps(config))
    assert_bad_input(capsys, out, ckpt, out, mentions=("config.json", "mask_token_id"))


def test_unknown_architecture(capsys, ckpt, out):
    edit_config(ckpt, architectures=["LlamaForCausalLM"])
    assert_bad_input(capsys, out, ckpt, out, mentions=("config.json", "unknown architecture", "LlamaForCausalLM"))


def test_missing_tensor(capsys, ckpt, out):
    edit_tensors(ckpt, lambda t: t.pop("layers.0.mlp.up_proj.weight"))
    assert_bad_input(capsys, out, ckpt, out, mentions=("model.safetensors", "missing tensor layers.0.mlp.up_proj.weight"))


def test_mis_shaped_tensor(capsys, ckpt, out):
    def shrink(t):
        t["fc.weight"] = t["fc.weight"][:, : 4 * HIDDEN_SIZE].contiguous()

    edit_tensors(ckpt, shrink)
    assert_bad_input(capsys, out, ckpt, out, mentions=("model.safetensors", "fc.weight", "shape"))


def test_config_with_more_layers_than_the_tensors(capsys, ckpt, out):
    edit_config(ckpt, num_hidden_layers=2)
    assert_bad_input(capsys, out, ckpt, out, mentions=("missing tensor layers.1.",))


def test_unexpected_tensor(capsys, ckpt, out):
    edit_tensors(ckpt, lambda t: t.update({"layers.0.extra.weight": torch.zeros(4)}))
    assert_bad_input(capsys, out, ckpt, out, mentions=("model.safetensors", "unexpected tensor layers.0.extra.weight"))


def test_d2t_without_draft_vocab_size(capsys, ckpt, out):
    edit_tensors(ckpt, lambda t: t.update({"d2t": torch.zeros(1000, dtype=torch.int64)}))
    assert_bad_input(capsys, out, ckpt, out, mentions=("model.safetensors", "d2t", "draft_vocab_size"))


def reduce_vocabulary(ckpt: Path, target_ids: torch.Tensor, *, dtype=torch.int64) -> None:
    """Give the checkpoint a reduced draft vocabulary: offsets `d2t` (id - row) and its own head rows."""
    n = len(target_ids)
    edit_config(ckpt, draft_vocab_size=n)
    offsets = (target_ids - torch.arange(n)).to(dtype)
    edit_tensors(ckpt, lambda t: t.update({"d2t": offsets, "lm_head.weight": torch.zeros(n, HIDDEN_SIZE, dtype=torch.bfloat16)}))


@pytest.mark.parametrize(
    "ids, problem",
    [
        (torch.tensor([5, 70000, 9]), "outside the vocabulary"),
        (torch.tensor([5, 5, 9]), "same target token"),
    ],
)
def test_bad_d2t_map(capsys, ckpt, out, ids, problem):
    reduce_vocabulary(ckpt, ids)
    assert_bad_input(capsys, out, ckpt, out, mentions=("d2t", problem))


def test_float_d2t_map(capsys, ckpt, out):
    reduce_vocabulary(ckpt, torch.tensor([5, 6, 9]), dtype=torch.float32)
    assert_bad_input(capsys, out, ckpt, out, mentions=("d2t", "integers"))


def test_truncated_safetensors(capsys, ckpt, out):
    st = ckpt / "model.safetensors"
    st.write_bytes(st.read_bytes()[: st.stat().st_size // 2])
    assert_bad_input(capsys, out, st, out, mentions=("model.safetensors", "truncated"))


def test_safetensors_with_a_cut_header(capsys, ckpt, out):
    st = ckpt / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])
    assert_bad_input(capsys, out, st, out, mentions=("model.safetensors", "corrupt"))


def test_safetensors_with_garbage_header(capsys, ckpt, out):
    st = ckpt / "model.safetensors"
    data = bytearray(st.read_bytes())
    data[8:40] = b"\xff" * 32
    st.write_bytes(bytes(data))
    assert_bad_input(capsys, out, st, out, mentions=("model.safetensors", "corrupt"))


def test_safetensors_with_inconsistent_offsets(capsys, ckpt, out):
    st = ckpt / "model.safetensors"
    raw = st.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = "norm.weight"
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + 2]
    encoded = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(encoded) == n
    st.write_bytes(raw[:8] + encoded + raw[8 + n :])
    assert_bad_input(capsys, out, st, out, mentions=("model.safetensors", "corrupt", name))


def test_pickle_checkpoint_is_refused_and_never_unpickled(capsys, tmp_path, out):
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    ckpt = tmp_path / "pickled"
    ckpt.mkdir()
    (ckpt / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    (ckpt / "config.json").write_text("{}")
    assert_bad_input(capsys, out, ckpt / "pytorch_model.bin", out, mentions=("pytorch_model.bin", "pickle"))
    assert_bad_input(capsys, out, ckpt, out, mentions=("pytorch_model.bin", "pickle"))
    assert not marker.exists()


def test_existing_output_without_force(capsys, reference_checkpoint, out):
    out.write_bytes(b"keep me")
    code, err = run_cli(capsys, reference_checkpoint, out, "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--force" in err and str(out) in err
    assert out.read_bytes() == b"keep me"
    assert not list(out.parent.glob(f".{out.name}.*"))


def test_target_that_is_not_a_gguf(capsys, reference_checkpoint, tmp_path, out):
    target = tmp_path / "target.gguf"
    target.write_text("not a gguf at all, just text\n")
    assert_bad_input(capsys, out, reference_checkpoint, out, "--target", target, mentions=("target.gguf", "GGUF"))


def test_missing_target(capsys, reference_checkpoint, tmp_path, out):
    assert_bad_input(capsys, out, reference_checkpoint, out, "--target", tmp_path / "none.gguf",
                     mentions=("none.gguf", "no such file"))


def test_target_with_another_hidden_size(capsys, reference_checkpoint, tmp_path, out):
    target = write_target(tmp_path / "wide.gguf", n_embd=1024)
    assert_bad_input(capsys, out, reference_checkpoint, out, "--target", target, mentions=("wide.gguf", "hidden size", "1024"))


def test_target_with_too_few_layers(capsys, reference_checkpoint, tmp_path, out):
    target = write_target(tmp_path / "shallow.gguf", n_layer=24)
    assert_bad_input(capsys, out, reference_checkpoint, out, "--target", target, mentions=("shallow.gguf", "layers", "24"))


def test_target_with_another_vocabulary_size(capsys, reference_checkpoint, tmp_path, out):
    target = write_target(tmp_path / "small_vocab.gguf", n_vocab=1000)
    assert_bad_input(capsys, out, reference_checkpoint, out, "--target", target, mentions=("small_vocab.gguf", "vocabulary", "1000"))


def test_recurrent_target(capsys, reference_checkpoint, tmp_path, out):
    target = write_target(tmp_path / "mamba.gguf", arch="mamba")
    assert_bad_input(capsys, out, reference_checkpoint, out, "--target", target, mentions=("mamba.gguf", "recurrent"))


def test_checkpoint_reading_layers_the_embedded_target_lacks(capsys, tmp_path, embedded_target, out):
    # HF id 29 is the last layer's output: GGUF input id 30 = n_layer, which libllama's llama graph never records
    ckpt = make_reference_checkpoint(tmp_path / "deep", target_layer_ids=(1, 8, 15, 22, 29))
    capsys.readouterr()  # save_pretrained's own progress output
    assert_bad_input(
        capsys, out, ckpt, out, "--target", embedded_target,
        mentions=(str(embedded_target), "[1, 8, 15, 22, 29]", "30-layer", "layer inputs 0..29"),
    )


def test_mask_token_outside_the_vocabulary(capsys, ckpt, out):
    config = json.loads((ckpt / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 49152
    (ckpt / "config.json").write_text(json.dumps(config))
    assert_bad_input(capsys, out, ckpt, out, mentions=("config.json", "mask_token_id 49152"))


def test_unknown_outtype_is_a_one_line_usage_error(capsys, reference_checkpoint, out):
    assert_bad_input(capsys, out, reference_checkpoint, out, "--outtype", "q4_0", mentions=("--outtype", "q4_0"))


def test_info_on_a_non_drafter(capsys, embedded_target):
    code, err = run_cli(capsys, "--info", embedded_target)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "llama" in err and embedded_target.name in err


def test_failure_while_writing_leaves_nothing(tmp_path):
    out = tmp_path / "x.gguf"
    with pytest.raises(RuntimeError), atomic_output(out, force=False) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_replaced_only_on_success(tmp_path):
    out = tmp_path / "x.gguf"
    out.write_bytes(b"old")
    with pytest.raises(ConversionError):
        with atomic_output(out, force=False):
            pass
    with pytest.raises(RuntimeError), atomic_output(out, force=True) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("interrupted")
    assert out.read_bytes() == b"old"
    with atomic_output(out, force=True) as tmp:
        tmp.write_bytes(b"new")
    assert out.read_bytes() == b"new" and list(tmp_path.iterdir()) == [out]


def test_output_gets_the_usual_permissions_not_the_temp_files(tmp_path):
    out = tmp_path / "x.gguf"
    old = os.umask(0o022)
    try:
        with atomic_output(out, force=False) as tmp:
            tmp.write_bytes(b"data")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # readable by others once installed, as any package file


def test_real_entry_point_exit_code_and_one_line(ckpt, out):
    (ckpt / "config.json").unlink()
    result = subprocess.run(
        [sys.executable, "-m", "dflash_gguf.convert", str(ckpt), str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "config.json" in result.stderr
    assert "Traceback" not in result.stderr and not out.exists()


# --- issue 15: every input the reliability probe broke the converter with -------------------------------------


def _rewrite_header(st: Path, edit) -> None:
    """Rewrite a safetensors header through `edit(header) -> text`, keeping the data section."""
    raw = st.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    text = edit(json.loads(raw[8 : 8 + n])).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    st.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def _set_offsets(name: str, offsets):
    def edit(header):
        header[name]["data_offsets"] = offsets(header[name]["data_offsets"], header)
        return json.dumps(header)
    return edit


@pytest.mark.parametrize(
    "edit, mentions",
    [
        # offsets pointing into the JSON header: its bytes were written as weights, exit 0
        (_set_offsets("norm.weight", lambda o, h: [-64, -64 + o[1] - o[0]]), ("norm.weight", "data_offsets")),
        (_set_offsets("norm.weight", lambda o, h: [o[0], o[1], o[1]]), ("norm.weight", "two integers")),
        (_set_offsets("norm.weight", lambda o, h: [float(o[0]), float(o[1])]), ("norm.weight", "two integers")),
        (_set_offsets("norm.weight", lambda o, h: [o[0], o[0] - 1]), ("norm.weight",)),
        (_set_offsets("norm.weight", lambda o, h: list(h["hidden_norm.weight"]["data_offsets"])), ("overlap",)),
        (lambda h: json.dumps(h)[:-1] + ',"norm.weight":' + json.dumps(h["norm.weight"]) + "}", ("norm.weight", "twice")),
        (lambda h: "[" * 100000 + "]" * 100000, ("nested too deeply",)),
        (lambda h: json.dumps(h).replace('"F32"', "NaN", 1) if '"F32"' in json.dumps(h) else json.dumps(h)[:-1] + ',"x":NaN}', ("NaN",)),
    ],
    ids=["into-header", "three-offsets", "float-offsets", "reversed", "overlap", "duplicate-key", "deep-json", "nan"],
)
def test_safetensors_offsets_are_checked_against_the_data_section(capsys, ckpt, out, edit, mentions):
    st = ckpt / "model.safetensors"
    _rewrite_header(st, edit)
    line = assert_bad_input(capsys, out, st, out, mentions=("model.safetensors", *mentions))
    assert "Traceback" not in line


@pytest.mark.parametrize(
    "edit, mentions",
    [
        (lambda c: c.update(rope_parameters="fast"), ("rope_parameters", "object")),
        (lambda c: c.update(rope_parameters={"rope_theta": "big"}), ("rope_theta", "number")),
        (lambda c: c.update(rope_parameters=None, rope_theta=[1e4]), ("rope_theta", "number")),
        (lambda c: c.update(rope_parameters={"rope_theta": -5.0}), ("rope_theta",)),
        (lambda c: c.update(max_position_embeddings=-1), ("max_position_embeddings",)),
        (lambda c: c.update(max_position_embeddings=2**40), ("max_position_embeddings",)),
        (lambda c: c["dflash_config"].update(block_size=1), ("block_size",)),
        (lambda c: c["dflash_config"].update(block_size=10**6), ("block_size",)),
        (lambda c: c["dflash_config"].update(block_size=16.0), ("block_size", "integer")),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, -3]), ("target_layer_ids",)),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 8, 40]), ("target_layer_ids", "num_target_layers")),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 2**40]), ("target_layer_ids",)),
        (lambda c: c["dflash_config"].update(output_multiplier="x2"), ("output_multiplier", "number")),
        (lambda c: c["dflash_config"].update(final_logit_softcapping=[30]), ("final_logit_softcapping", "number")),
        (lambda c: c["dflash_config"].update(input_embedding_scale=1e39), ("input_embedding_scale", "finite")),
        (lambda c: c["dflash_config"].update(attention_value_scale=True), ("attention_value_scale", "number")),
        (lambda c: c.update(sliding_window="64", use_sliding_window=True), ("sliding_window", "integer")),
        (lambda c: c["dflash_config"].update(use_swa="yes"), ("use_swa", "true or false")),
        (lambda c: c.update(architectures=[["DFlashDraftModel"]]), ("architectures",)),
        (lambda c: c.update(architectures="DFlashDraftModel"), ("architectures",)),
        (lambda c: c.update(rms_norm_eps=1e-50), ("rms_norm_eps", "float32")),
        (lambda c: c.update(num_hidden_layers=600), ("num_hidden_layers",)),
        (lambda c: c.update(num_key_value_heads=2), ("num_key_value_heads",)),
        (lambda c: c.update(partial_rotary_factor=0.01), ("partial_rotary_factor",)),
        (lambda c: c.update(head_dim="64"), ("head_dim", "integer")),
        (lambda c: c.update(hidden_act=["silu"]), ("hidden_act", "string")),
        (lambda c: c.update(is_causal="false"), ("is_causal", "true or false")),
    ],
)
def test_config_keys_are_type_and_range_checked_in_one_line(capsys, ckpt, out, edit, mentions):
    path = ckpt / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    assert_bad_input(capsys, out, ckpt, out, mentions=("config.json", *mentions))


@pytest.mark.parametrize("text, mentions", [
    ('{"a": ' * 50000 + "1" + "}" * 50000, ("nested too deeply",)),
    ('{"architectures": ["DFlashDraftModel"], "architectures": ["X"]}', ("twice",)),
    ('{"rms_norm_eps": NaN}', ("NaN",)),
])
def test_malformed_config_json_is_one_line(capsys, ckpt, out, text, mentions):
    (ckpt / "config.json").write_text(text)
    assert_bad_input(capsys, out, ckpt, out, mentions=("config.json", *mentions))


def _cli(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_gguf.convert", *map(str, args), "--no-progress"],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("which", ["model.safetensors", "config.json"])
def test_a_fifo_input_is_one_line_not_a_hang(ckpt, out, which):
    (ckpt / which).unlink()
    os.mkfifo(ckpt / which)
    result = _cli(ckpt, out, timeout=60)  # a hang fails here with TimeoutExpired
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "FIFO" in result.stderr and which in result.stderr and not out.exists()


def test_a_device_as_target_is_one_line(capsys, reference_checkpoint, out):
    assert_bad_input(capsys, out, reference_checkpoint, out, "--target", "/dev/zero", mentions=("/dev/zero", "device"))


@pytest.mark.parametrize("which", ["target", "config.json", "model.safetensors"])
@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_out_is_never_an_input_even_with_force(capsys, ckpt, tmp_path, which, how):
    target = write_target(tmp_path / "target.gguf")
    victim = target if which == "target" else ckpt / which
    before = victim.read_bytes()
    if how == "same":
        out = victim
    elif how == "symlink":
        out = tmp_path / "link.gguf"
        out.symlink_to(victim)
    else:
        out = tmp_path / "hard.gguf"
        os.link(victim, out)
    code, err = run_cli(capsys, ckpt, out, "--target", target, "--force", "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "one of the inputs" in err, err
    assert victim.read_bytes() == before
    assert not list(tmp_path.rglob("*.tmp"))


# --- DSpark keys: checked by the schema before normalisation reads them ------------------------------------------------


@pytest.fixture(scope="module")
def dspark_ckpt(tmp_path_factory) -> Path:
    from dspark_reference import make_dspark_checkpoint

    return make_dspark_checkpoint(tmp_path_factory.mktemp("dspark") / "ckpt", confidence=False)


@pytest.mark.parametrize(
    "changes, mentions",
    [
        ({"transformer_layer_config": {"dflash_config": ["markov_rank"]}}, ("transformer_layer_config.dflash_config", "object")),
        ({"transformer_layer_config": [1]}, ("transformer_layer_config", "object")),
        ({"transformer_layer_config": {"markov_rank": 2.5}}, ("transformer_layer_config.markov_rank", "integer")),
        ({"aux_hidden_state_layer_ids": [0, 9]}, ("aux_hidden_state_layer_ids",)),
        ({"aux_hidden_state_layer_ids": "2,9"}, ("aux_hidden_state_layer_ids", "list of integers")),
        ({"aux_hidden_state_layer_ids": []}, ("aux_hidden_state_layer_ids", "non-empty")),
        ({"sample_from_anchor": "yes"}, ("sample_from_anchor", "true or false")),
        ({"markov_head_type": "gated"}, ("markov_head_type", "gated", "vanilla")),
        ({"markov_head_type": ["vanilla"]}, ("markov_head_type", "string")),
        ({"dflash_config": {"markov_head_type": 5}}, ("dflash_config.markov_head_type", "string")),
        ({"markov_rank": "32"}, ("markov_rank", "integer")),
        ({"markov_rank": 0}, ("markov_rank 0", "DFlash")),
        ({"architectures": ["Gemma4DSparkModel"]}, ("Gemma4DSparkModel", "not supported")),
        ({"architectures": ["DeepseekV4DSparkModel"]}, ("DeepseekV4DSparkModel", "not supported")),
    ],
)
def test_dspark_keys_are_checked_before_use_in_one_line(capsys, dspark_ckpt, tmp_path, out, changes, mentions):
    ckpt = Path(shutil.copytree(dspark_ckpt, tmp_path / "ckpt"))
    edit_config(ckpt, **changes)
    assert_bad_input(capsys, out, ckpt, out, mentions=("config.json", *mentions))


# --- mask_embedding.pt -------------------------------------------------------------------------------------------------


def _mask_pt(ckpt: Path, value) -> Path:
    path = ckpt / "mask_embedding.pt"
    torch.save(value, path)
    return path


@pytest.mark.parametrize(
    "value, mentions",
    [
        ({"mask_token_id": 17, "embedding": torch.zeros(HIDDEN_SIZE)}, ("mask_token_id 17", "16")),
        ({"mask_token_id": 16, "embedding": torch.zeros(HIDDEN_SIZE - 1)}, ("embedding", f"[{HIDDEN_SIZE}]")),
        ({"mask_token_id": 16, "embedding": torch.full((HIDDEN_SIZE,), float("nan"))}, ("embedding", "NaN")),
        ({"mask_token_id": 16}, ("dict with mask_token_id and embedding",)),
        (torch.zeros(HIDDEN_SIZE), ("dict with mask_token_id and embedding",)),
    ],
)
def test_bad_mask_embedding_is_one_line(capsys, ckpt, out, embedded_target, value, mentions):
    _mask_pt(ckpt, value)
    assert_bad_input(capsys, out, ckpt, out, "--target", embedded_target, mentions=("mask_embedding.pt", *mentions))


def test_mask_embedding_needs_the_target(capsys, ckpt, out):
    _mask_pt(ckpt, {"mask_token_id": 16, "embedding": torch.zeros(HIDDEN_SIZE)})
    assert_bad_input(capsys, out, ckpt, out, mentions=("mask_embedding.pt", "--target"))


def test_mask_embedding_is_never_unpickled_with_plain_pickle(capsys, ckpt, out, embedded_target, tmp_path):
    marker = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (ckpt / "mask_embedding.pt").write_bytes(pickle.dumps({"mask_token_id": 16, "embedding": Payload()}))
    assert_bad_input(capsys, out, ckpt, out, "--target", embedded_target, mentions=("mask_embedding.pt", "weights-only"))
    torch.save({"mask_token_id": 16, "embedding": Payload()}, ckpt / "mask_embedding.pt")
    assert_bad_input(capsys, out, ckpt, out, "--target", embedded_target, mentions=("mask_embedding.pt", "weights-only"))
    assert not marker.exists()


def test_mask_embedding_without_torch_is_one_line(ckpt, out):
    """torch is optional for the converter: without it, a mask_embedding.pt is refused in one line (exit 2)."""
    _mask_pt(ckpt, {"mask_token_id": 16, "embedding": torch.zeros(HIDDEN_SIZE)})
    code = ("import sys; sys.modules['torch'] = None; from dflash_gguf.convert.cli import main; "
            f"sys.exit(main([{str(ckpt)!r}, {str(out)!r}, '--no-progress']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "mask_embedding.pt" in lines[0] and "needs torch" in lines[0], p.stderr
    assert not out.exists()


@pytest.mark.parametrize("key", ["aux_hidden_state_layer_ids", "transformer_layer_config", "sample_from_anchor"])
def test_dspark_keys_set_to_null_are_absent(dspark_ckpt, tmp_path, key):
    """A JSON null is an absent key (the long fuzz run found `aux_hidden_state_layer_ids: null` raising a TypeError)."""
    from dflash_gguf.convert.checkpoint import load_checkpoint

    ckpt = Path(shutil.copytree(dspark_ckpt, tmp_path / "ckpt"))
    edit_config(ckpt, **{key: None})
    cfg = load_checkpoint(ckpt).config
    assert cfg.sample_from_anchor is True and list(cfg.target_layer_ids) == [1, 8, 15, 22, 27]

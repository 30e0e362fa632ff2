"""dflash-train's bad-input handling: one line on stderr, exit 2, nothing half-written."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest

from dflash_gguf.train.cli import main
from dflash_gguf.train.data import estimate_cache_bytes, GenerationSettings


def prompts_file(path, n=3):
    path.write_text("".join(json.dumps({"id": f"p{i}", "category": "math", "prompt": f"What is {i}+1?"}) + "\n" for i in range(n)))
    return path


def run(capsys, *args):
    code = main([str(a) for a in args])
    err = capsys.readouterr().err.strip()
    return code, err


def assert_one_line_error(code, err, needle):
    assert code == 2
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("dflash-train: error: ") and needle in err


def test_missing_target(tmp_path, capsys):
    code, err = run(capsys, tmp_path / "nope.gguf", prompts_file(tmp_path / "p.jsonl"), "--out", tmp_path / "run")
    assert_one_line_error(code, err, "target not found")


def test_target_that_is_not_gguf(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    code, err = run(capsys, bad, prompts_file(tmp_path / "p.jsonl"), "--out", tmp_path / "run")
    assert_one_line_error(code, err, "bad.gguf")


def test_recurrent_target_is_refused(tmp_path, capsys):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_token_list(["a", "b", "c"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, err = run(capsys, path, prompts_file(tmp_path / "p.jsonl"), "--out", tmp_path / "run")
    assert_one_line_error(code, err, "recurrent")


def test_malformed_prompts_name_the_line(embedded_target, tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "ok", "category": "math"}) + "\n{broken\n")
    code, err = run(capsys, embedded_target, p, "--out", tmp_path / "run")
    assert_one_line_error(code, err, "p.jsonl:2: not valid JSON")


def test_empty_prompts(embedded_target, tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text("")
    code, err = run(capsys, embedded_target, p, "--out", tmp_path / "run")
    assert_one_line_error(code, err, "no prompts")


def test_too_little_disk_for_the_cache_is_refused_before_generating(embedded_target, tmp_path, capsys):
    settings = GenerationSettings(max_seq_len=8192)
    per_prompt = estimate_cache_bytes(1, settings, 5 * 576 * 2)
    n = int(shutil.disk_usage(tmp_path).free / per_prompt) + 10  # more than the real free disk holds
    code, err = run(
        capsys, embedded_target, prompts_file(tmp_path / "p.jsonl", n), "--out", tmp_path / "run",
        "--max-seq-len", 8192, "--test-per-category", 0,
    )
    assert_one_line_error(code, err, "not enough disk")
    manifest = json.loads((tmp_path / "run" / "data" / "manifest.json").read_text())
    assert manifest["sequences"] == []  # nothing generated


@pytest.mark.parametrize(
    "flag, value, needle",
    [("--steps", -1, "steps"), ("--block-size", 1, "block_size"), ("--outtype", "q2", "outtype"), ("--max-seq-len", 99999, "context length")],
)
def test_bad_settings(embedded_target, tmp_path, capsys, flag, value, needle):
    code, err = run(capsys, embedded_target, prompts_file(tmp_path / "p.jsonl"), "--out", tmp_path / "run", flag, value)
    assert_one_line_error(code, err, needle)


@pytest.mark.parametrize("args,needle", [
    (["--kind", "dflash2", "--draft-vocab", "8192"], "needs the full vocabulary"),
    (["--soft-labels", "1.5"], "soft_labels must be in [0, 1]"),
    (["--soft-labels", "0.5", "--top-k", "0"], "soft labels need the target's top-k"),
    (["--markov-rank", "0", "--kind", "dspark"], "markov_rank must be >= 1"),
])
def test_new_options_with_values_no_run_can_use(tmp_path, capsys, embedded_target, args, needle):
    code, err = run(capsys, embedded_target, prompts_file(tmp_path / "p.jsonl"), "--out", tmp_path / "run", *args)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "run").exists()


def test_archive_that_does_not_exist(tmp_path, capsys, embedded_target):
    code, err = run(capsys, embedded_target, prompts_file(tmp_path / "p.jsonl"), "--out", tmp_path / "run",
                    "--stage", "data", "--from-archive", tmp_path / "none.npz")
    assert_one_line_error(code, err, "token archive not found")


def test_archive_stage_without_a_cache(tmp_path, capsys, embedded_target):
    code, err = run(capsys, embedded_target, prompts_file(tmp_path / "p.jsonl"), "--out", tmp_path / "run", "--stage", "archive")
    assert_one_line_error(code, err, "no feature cache")
    assert not (tmp_path / "run" / "tokens.npz").exists()

"""dflash-generate: a real generation on the embedded target, and one-line errors for bad input."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dflash_gguf import Session
from dflash_gguf.cli import _check_args, _parser, compare, main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_gguf.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow  # dflash-generate in a fresh process: imports, loads both models, generates three pairs
def test_generates_and_compares_with_plain_decoding(dflash_gguf_path, embedded_target):
    p = run("--target", str(embedded_target), "--drafter", str(dflash_gguf_path), "--threads", "2",
            "--n-ctx", "512", "--max-tokens", "12", "--block-size", "4", "--compare", "Name a fruit.")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()
    lines = [line for line in p.stderr.splitlines() if line.startswith(("dflash:", "plain", "speedup"))]
    assert lines[0].startswith("dflash: τ ") and "tok/s decode" in lines[0]
    assert lines[1].startswith("plain, ")
    assert "x over plain decoding" in lines[2] and "outputs identical" in lines[2]
    # the median of three pairs run in lockstep, with their range
    shown, low, high = map(float, re.search(
        r"speedup ([\d.]+)x over plain decoding of the same target \(the median of 3 pairs run in lockstep, "
        r"([\d.]+)-([\d.]+)x;", lines[2]).groups())
    assert 0 < low <= shown <= high


def test_compare_prints_the_median_and_range_of_its_pairs(dflash_gguf_path, embedded_target, capsys):
    """Each pair's ratio is dflash_gguf.stats' one definition (loop tok/s over the plain run's loop tok/s)."""
    p = _parser()
    a = p.parse_args(["--target", str(embedded_target), "--drafter", str(dflash_gguf_path), "--threads", "1",
                      "--n-ctx", "256", "--max-tokens", "6", "--block-size", "4", "--raw", "--compare", "The sky is"])
    config, options = _check_args(p, a)
    with Session(a.target, a.drafter, options) as s:
        ratios = compare(s, a, a.prompt, config, 3)
    out = capsys.readouterr()
    assert len(ratios) == 3 and all(r > 0 for r in ratios)
    median, low, high = sorted(ratios)[1], min(ratios), max(ratios)
    assert (f"speedup {median:.2f}x over plain decoding of the same target (the median of 3 pairs run in lockstep, "
            f"{low:.2f}-{high:.2f}x; loop tok/s, measured now)") in out.err
    assert out.out.strip() and "outputs identical" in out.err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "/nonexistent.gguf", "hi"], "no such file"),
        (["--drafter", "/nonexistent.gguf", "hi"], "--drafter needs --target"),
        (["--max-tokens", "0", "hi"], "argument --max-tokens: must be"),
        (["--raw", "--system", "be brief", "hi"], "--system has no place"),
        (["--temperature", "-1", "--max-tokens", "2", "hi"], "temperature"),
        (["--repeat-penalty", "0", "--max-tokens", "2", "hi"], "argument --repeat-penalty: must be a finite number > 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and message in err[0], err


def test_a_target_that_is_not_gguf(tmp_path, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_text("not a model")
    assert main(["--target", str(junk), "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a GGUF file" in err[0]

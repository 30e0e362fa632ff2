"""dflash-generate: a real generation on the embedded target, and one-line errors for bad input."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dflash_gguf.cli import main


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflash_gguf.cli", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow  # dflash-generate in a fresh process: imports, loads both models, generates twice
def test_generates_and_compares_with_plain_decoding(dflash_gguf_path, embedded_target):
    p = run("--target", str(embedded_target), "--drafter", str(dflash_gguf_path), "--threads", "2",
            "--n-ctx", "512", "--max-tokens", "12", "--block-size", "4", "--compare", "Name a fruit.")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()
    lines = [line for line in p.stderr.splitlines() if line.startswith(("dflash:", "plain", "speedup"))]
    assert lines[0].startswith("dflash: τ ") and "tok/s decode" in lines[0]
    assert lines[1].startswith("plain, ")
    assert "x over plain decoding" in lines[2] and "outputs identical" in lines[2]
    # the speedup is dflash_gguf.stats' one definition: loop tok/s over the plain run's loop tok/s
    loop = [float(re.search(r"([\d.]+) tok/s in the loop", line).group(1)) for line in lines[:2]]
    shown = float(re.search(r"speedup ([\d.]+)x", lines[2]).group(1))
    assert shown == pytest.approx(loop[0] / loop[1], abs=0.01 + 0.06 * shown / min(loop))  # printed to 0.1 tok/s


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

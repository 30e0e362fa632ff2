"""dflash-chat's command line: every bad flag or file is one line on stderr and exit 2, before any UI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from dflash_gguf.config import CacheOptions
from dflash_gguf.tui.cli import parse_options

pytestmark = pytest.mark.slow  # every case runs dflash-chat in a fresh process


def run_chat(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dflash_gguf.tui.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("dflash-chat: error:")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    # nothing was drawn: the UI never started
    assert result.stdout == ""
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--bogus"], "--bogus"),
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "warm"], "--temperature"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "-3"], "--top-k"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--block-size", "0"], "--block-size"),
        (["--n-ctx", "8"], "--n-ctx"),
        (["--n-gpu-layers", "-2"], "--n-gpu-layers"),
        (["--seed", "x"], "--seed"),
        (["--worker", "fork"], "--worker"),
        (["--cache-ram", "2 GiBs"], "argument --cache-ram: not a size"),
        (["--cache-disk", "-1"], "argument --cache-disk: not a size"),
        (["--cache-dir", "/etc/hostname"], "argument --cache-dir: /etc/hostname exists and is not a directory"),
    ],
)
def test_bad_flag_is_one_line_exit_2(args: list[str], needle: str) -> None:
    assert_one_line_error(run_chat(*args), needle)


def test_missing_target_file_is_one_line_exit_2(tmp_path) -> None:
    missing = tmp_path / "nope.gguf"
    assert_one_line_error(run_chat("--target", str(missing)), "--target", "no such file")


def test_missing_drafter_file_is_one_line_exit_2(tmp_path) -> None:
    missing = tmp_path / "nope.gguf"
    assert_one_line_error(run_chat("--drafter", str(missing)), "--drafter", "no such file")


@pytest.mark.parametrize("worker", ["process", "thread"])
def test_target_that_is_not_gguf_is_one_line_exit_2(tmp_path, worker: str) -> None:
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("this is not a model\n")
    assert_one_line_error(run_chat("--target", str(bogus), "--worker", worker), str(bogus))


def test_drafter_that_is_not_a_drafter_is_one_line_exit_2(embedded_target) -> None:
    # a real GGUF, but a llama model, not a dflash drafter
    assert_one_line_error(run_chat("--drafter", str(embedded_target)), str(embedded_target.name))


def test_block_size_beyond_the_drafter_is_one_line_exit_2(dflash_gguf_path) -> None:
    assert_one_line_error(run_chat("--drafter", str(dflash_gguf_path), "--block-size", "999"), "--block-size")


def test_help_exits_0() -> None:
    result = run_chat("--help")
    assert result.returncode == 0
    for flag in ("--target", "--drafter", "--n-gpu-layers", "--n-ctx", "--block-size", "--temperature",
                 "--top-p", "--top-k", "--seed", "--system", "--max-tokens", "--lookup", "--no-lookup", "--worker",
                 "--cache-ram", "--cache-dir", "--cache-disk"):
        assert flag in result.stdout


def test_cache_flags_make_the_sessions_cache_options(tmp_path) -> None:
    """The flags are dflash-serve's own settings (CacheOptions): sizes parsed, the directory kept for the worker."""
    args, _ = parse_options(["--cache-ram", "64MiB", "--cache-dir", str(tmp_path), "--cache-disk", "1GiB"])
    assert args.cache == CacheOptions(cache_ram=64 << 20, cache_dir=tmp_path, cache_disk=1 << 30)
    assert not parse_options([])[0].cache.enabled

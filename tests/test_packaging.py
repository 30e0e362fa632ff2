"""The built wheel ships what a user's install needs: the drafter, its card, the bench prompts, the TUI styles."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds the wheel with pip

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_embedded_drafter_and_package_data(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-v", "-w", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    # setuptools warns (and will one day drop) data folders that are not listed as packages
    assert "is absent from the `packages` configuration" not in run.stdout + run.stderr
    [wheel] = tmp_path.glob("dflash_gguf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for path in (
        "dflash_gguf/models/SmolLM2-135M-Instruct-DFlash.gguf",
        "dflash_gguf/models/SmolLM2-135M-Instruct-DFlash.md",
        "dflash_gguf/data/bench_prompts.jsonl",
        "dflash_gguf/tui/app.tcss",
        "dflash_gguf/convert/cli.py",
        "dflash_gguf/tui/app.py",
    ):
        assert path in names, path
    assert not any(n.startswith(("convert/", "tui/", "tests/")) for n in names), "no generic top-level packages"

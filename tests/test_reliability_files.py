"""Files that are not what they should be (issue 35, probe items 4 and 5): a FIFO at the saved-calibration
path is a logged miss, never a hang; a prompt-cache directory that becomes unwritable while running costs
one warning line per write, no traceback, and generation goes on."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from dflash_gguf import Session, calibration_store
from dflash_gguf.controller import CostModel
from dflash_gguf.prompt_cache import PromptCache

KEY = {"format": calibration_store.FORMAT, "test": "a FIFO at the path"}
COSTS = CostModel({1: 0.010, 4: 0.012}, {4: 0.002})
PROMPT = "The report lists the inventory of the forest station: copper, lanterns and rope. " * 3


def test_a_fifo_at_the_calibration_path_is_a_logged_miss(caplog):
    path = calibration_store.path_for(KEY)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    done = threading.Event()

    def unblock() -> None:  # a load that blocks in open() fails this test instead of hanging the suite
        if not done.wait(20):
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)

    threading.Thread(target=unblock, daemon=True).start()
    try:
        with caplog.at_level(logging.WARNING, logger="dflash_gguf.calibration"):
            assert calibration_store.load(KEY) is None
    finally:
        done.set()
    assert any("not a regular file" in r.getMessage() for r in caplog.records), caplog.text
    assert calibration_store.save(KEY, COSTS) == path  # the measurement replaces the FIFO
    assert calibration_store.load(KEY).target.points() == COSTS.target.points()


def test_a_directory_at_the_calibration_path_is_a_logged_miss(caplog):
    path = calibration_store.path_for(KEY)
    path.mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="dflash_gguf.calibration"):
        assert calibration_store.load(KEY) is None
    assert any("not a regular file" in r.getMessage() for r in caplog.records), caplog.text


def _generate_twice(session: Session, between) -> list[str]:
    """Two generations of the same prompt with `between` done to the cache directory in between."""
    session.generate(PROMPT, max_tokens=4, block_size=4)
    session.prompt_cache.flush()
    between()
    session.reset()
    return session.generate(PROMPT + "And then?", max_tokens=4, block_size=4).tokens


def test_a_cache_directory_replaced_by_a_file_logs_one_line_per_write(tmp_path, caplog):
    directory = tmp_path / "cache"

    def replace_by_a_file() -> None:
        shutil.rmtree(directory)
        directory.write_text("not a directory any more")

    with Session(prompt_cache=PromptCache(directory=directory), n_ctx=512, n_threads=1) as s:
        with caplog.at_level(logging.WARNING, logger="dflash_gguf.prompt_cache"):
            tokens = _generate_twice(s, replace_by_a_file)
            s.prompt_cache.flush()
    assert len(tokens) == 4
    writes = [r for r in caplog.records if "could not write" in r.getMessage()]
    assert len(writes) == 1 and "Not a directory" in writes[0].getMessage()
    assert not any(r.exc_info for r in caplog.records), caplog.text  # no traceback


EROFS_RUN = textwrap.dedent("""
    import logging, subprocess, sys
    from dflash_gguf import Session
    from dflash_gguf.prompt_cache import PromptCache
    sys.path.insert(0, sys.argv[2])
    from test_reliability_files import _generate_twice
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    d = sys.argv[1]
    def read_only():
        subprocess.run(["mount", "--bind", d, d], check=True)
        subprocess.run(["mount", "-o", "remount,ro,bind", d], check=True)
    with Session(prompt_cache=PromptCache(directory=d), n_ctx=512, n_threads=1) as s:
        print("tokens", len(_generate_twice(s, read_only)), flush=True)
""")


def test_a_cache_directory_remounted_read_only_logs_one_line_per_write(tmp_path):
    """The probe's case: a read-only bind mount (EROFS, which no root privilege gets past), made in a mount
    namespace of the child's own so that nothing outside the test sees it."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or \
            subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and a mount namespace (unshare -m) to make a read-only bind mount")
    directory = tmp_path / "cache"
    directory.mkdir()
    tests = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", EROFS_RUN,
                          str(directory), tests], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "tokens 4" in run.stdout
    writes = [line for line in run.stderr.splitlines() if "could not write" in line]
    assert len(writes) == 1 and "Read-only file system" in writes[0], run.stderr
    assert "Traceback" not in run.stderr, run.stderr

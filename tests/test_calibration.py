"""Calibration measures what the loop will pay, and never stands in the way of a valid call (issues 10, 15)."""

from __future__ import annotations

import importlib
import json
import logging
import warnings
from pathlib import Path

import pytest

from dflash_gguf import Session, calibration_store
from dflash_gguf.config import SessionOptions, from_arguments

N_CTX, N_BATCH = 512, 64


@pytest.mark.slow  # on the hybrid targets, which upstream's converter builds first
@pytest.mark.parametrize("arch,mechanism", [("qwen35", "snapshot"), ("qwen3next", "checkpoint")])
def test_calibration_rolls_back_with_the_loops_mechanism(hybrid_models, arch, mechanism):
    """At position 0 a hybrid memory rolls back by clearing, which no verify in the loop does: calibration
    times its batches after a one-token prefix, so the rollback it prices is the snapshot or the
    checkpoint restore the loop will use, and the cost model has a rollback table."""
    with Session(hybrid_models.target(arch), hybrid_models.drafter(arch, "dflash"), n_ctx=N_CTX, n_batch=N_BATCH,
                 n_threads=1, lookup=False) as s:
        # n_rs_seq sized from the drafter's block without being asked (libllama clamps it for qwen3next)
        assert s.target.n_rs_seq == (15 if mechanism == "snapshot" else 0)
        before = dict(s.memory.rollbacks)
        s.calibrate()  # the drafter's controller is built from what its passes and the verify batches cost
        controller = s._speculation.native.controller
        done = {k: s.memory.rollbacks[k] - before[k] for k in before}
        if mechanism == "snapshot":  # every verify batch; timing a draft pass drops its one token by checkpoint
            assert done["snapshot"] > 0, done
        else:
            assert done["checkpoint"] > 0 and done["snapshot"] == 0, done
        assert controller.costs.rollback is not None and set(controller.costs.rollback.points()) >= {2, 16}
        assert s.target.pos_max(0) == -1  # the prefix is gone again
        r = s.generate("Good morning!", max_tokens=12)
        assert r.stats.memory == ("rs-snapshot" if mechanism == "snapshot" else "checkpoint")


@pytest.mark.slow  # on the hybrid targets, which upstream's converter builds first
def test_lookup_calibration_on_a_hybrid_target_prices_its_rollback(hybrid_models):
    with Session(hybrid_models.target("qwen35"), n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as s:
        costs = s._verify_costs()
        assert costs.rollback is not None and max(costs.rollback.points()) == s._lookup.max_draft + 1
        assert s.memory.rollbacks["checkpoint"] > 0  # lookup alone: no snapshots, as upstream sizes n_rs_seq


def test_a_batch_of_one_token_decodes_plainly_and_says_so_once(embedded_target, dflash_gguf_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Session(embedded_target, dflash_gguf_path, n_ctx=256, n_batch=1, n_threads=1) as s:
            first = s.generate("The capital of France is", max_tokens=6)
            second = s.generate("The capital of France is", max_tokens=6)
    said = [w for w in caught if "n_batch=1" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    for r in (first, second):
        assert not r.stats.speculative and r.stats.n_drafted == 0
        assert "n_batch=1" in r.stats.speculative_disabled_reason
    assert first.tokens == second.tokens and len(first.tokens) == 6


@pytest.mark.slow  # adaptive generation: measures the verify costs first
def test_the_first_adaptive_generation_after_plain_ones_calibrates(dflash_gguf_path):
    """Plain generations advance the target but not the drafter: calibrating then at the target's position
    made the drafter inject out of order (libllama refused the batch)."""
    m = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]
    with Session(drafter=dflash_gguf_path, n_ctx=1024, n_threads=1, lookup=False) as s:
        s.chat(m, max_tokens=8, block_size=4)
        plain = s.chat(m, max_tokens=30, speculative=False)
        again = s.chat(m, max_tokens=30)
    assert again.tokens == plain.tokens and again.stats.speculative


# -- saved calibration (issue 24): measured once per build, device, models and settings ----------------------
SMALL = {"n_ctx": 256, "n_batch": 8, "lookup": False}  # a block of 8: a short calibration


def _first_costs(s: Session) -> dict[int, float]:
    """Open the cost model the way the first adaptive cycle does, and give its verify table."""
    return s._verify_costs().target.points()


def _calibration_files() -> list[Path]:
    return sorted(calibration_store.directory().glob("*.json"))


def test_a_second_session_on_the_same_files_reuses_the_saved_calibration(dflash_gguf_path):
    with Session(drafter=dflash_gguf_path, n_threads=1, **SMALL) as first:
        assert first.calibration_source is None
        measured = _first_costs(first)
        decodes = first.target.decode_count
        assert first.calibration_source == "measured" and decodes > 0
    [saved] = _calibration_files()
    assert {int(n): s for n, s in json.loads(saved.read_text())["costs"]["target"].items()} == measured
    with Session(drafter=dflash_gguf_path, n_threads=1, **SMALL) as second:
        assert _first_costs(second) == measured
        assert second.calibration_source == "saved" and second.target.decode_count == 0  # nothing timed
        r = second.generate("The capital of France is", max_tokens=6)
    assert r.stats.calibration_source == "saved" and r.stats.speculative
    assert _calibration_files() == [saved]


def test_changed_threads_or_recalibrate_measure_again(dflash_gguf_path):
    with Session(drafter=dflash_gguf_path, n_threads=1, **SMALL) as s:
        _first_costs(s)
    with Session(drafter=dflash_gguf_path, n_threads=2, **SMALL) as s:
        _first_costs(s)
        assert s.calibration_source == "measured"  # another key: threads are part of it
    assert len(_calibration_files()) == 2
    with Session(drafter=dflash_gguf_path, n_threads=1, recalibrate=True, **SMALL) as s:
        _first_costs(s)
        assert s.calibration_source == "measured" and s.target.decode_count > 0
    assert len(_calibration_files()) == 2  # measured again into the same key's file


def test_lookup_alone_saves_its_verify_curve_too(embedded_target):
    for expected in ("measured", "saved"):
        with Session(embedded_target, n_threads=1, n_ctx=256, n_batch=8) as s:
            assert s.lookup and max(_first_costs(s)) == 8
            assert s.calibration_source == expected


@pytest.mark.parametrize("damage, logged", [
    (lambda raw: raw[: len(raw) // 2], "is corrupt"),
    (lambda raw: raw.replace(b'"1": ', b'"1": -'), "is corrupt"),  # a negative time
    (lambda raw: b"[1, 2, 3]", "another build"),
    (lambda raw: raw.replace(b'"n_threads": 1', b'"n_threads": 3'), "another build"),  # another key's file
    (lambda raw: b"\xff\xfe not utf-8", "cannot read"),
], ids=["truncated", "negative-time", "not-an-object", "foreign-key", "not-utf-8"])
def test_a_corrupt_or_foreign_file_is_a_logged_miss_and_is_measured_again(embedded_target, caplog, damage, logged):
    settings = dict(n_threads=1, n_ctx=256, n_batch=8)
    with Session(embedded_target, **settings) as s:
        good = _first_costs(s)
    [path] = _calibration_files()
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.INFO, logger="dflash_gguf.calibration"):
        with Session(embedded_target, **settings) as s:
            assert set(_first_costs(s)) == set(good)
            assert s.calibration_source == "measured"
    assert any(logged in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), caplog.text
    with Session(embedded_target, **settings) as s:  # the measurement replaced the damaged file
        _first_costs(s)
        assert s.calibration_source == "saved"


def test_a_folder_that_cannot_be_written_is_a_logged_miss(embedded_target, tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv(calibration_store.ENV_DIR, str(blocked / "calibration"))
    with caplog.at_level(logging.WARNING, logger="dflash_gguf.calibration"):
        with Session(embedded_target, n_threads=1, n_ctx=256, n_batch=8) as s:
            r = s.generate("The capital of France is", max_tokens=4)
    assert r.stats.calibration_source == "measured"
    assert any("cannot save" in rec.getMessage() for rec in caplog.records), caplog.text


def test_the_folder_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(calibration_store.ENV_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert calibration_store.directory() == tmp_path / "dflash-gguf" / "calibration"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert calibration_store.directory() == tmp_path / ".cache" / "dflash-gguf" / "calibration"


@pytest.mark.parametrize("cli", ["dflash_gguf.cli", "dflash_gguf.server.cli", "dflash_gguf.tui.cli", "dflash_gguf.bench.cli"])
def test_every_cli_that_opens_a_session_takes_recalibrate(cli):
    module = importlib.import_module(cli)
    parser = (getattr(module, "build_parser", None) or module._parser)()
    positional = ["a prompt"] if cli == "dflash_gguf.cli" else []
    for argv, expected in ((["--recalibrate"], True), ([], False)):
        args = parser.parse_args(positional + argv)
        assert from_arguments(parser, SessionOptions, args, module.SESSION).recalibrate is expected

"""dflash-doctor on the embedded pair: a report measured on this machine, as text and JSON, and one-line errors."""

from __future__ import annotations

import json

import pytest

from dflash_gguf.backends import gpu_devices
from dflash_gguf.doctor import main


@pytest.mark.slow
def test_the_report_measures_the_pair_on_this_machine(capsys):
    assert main(["--json", "--n-ctx", "1024", "--threads", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["build"]["layer_input_api"] is True and "CPU" in report["build"]["backends"]
    assert [d["name"] for d in report["build"]["devices"] if d["kind"] == "cpu"] == ["CPU"]
    pair = report["pair"]
    if not gpu_devices():  # where the layers are, from the models' own device lists: the CPU here
        assert pair["target_placement"] == {"backend": "CPU", "device": "CPU", "layers_offloaded": "0/31", "devices": []}
        assert pair["drafter_placement"]["device"] == "CPU"
    assert pair["kind"] == "dflash" and pair["block_size"] == 16 and len(pair["fingerprint"]) >= 16
    assert pair["trees_off_because"] is None  # a dense target: cycles may verify trees
    relative = {int(n): v for n, v in report["costs"]["verify_relative"].items()}
    assert relative[1] == 1.0 and all(relative[n] <= relative[n + 1] for n in range(1, 16))  # measured, monotone
    ceiling = {int(n): v for n, v in report["ceiling"].items()}
    assert all(ceiling[n] == pytest.approx(n / relative[n]) for n in ceiling)
    tau = report["tau"]
    assert len(tau["per_prompt"]) == 3 and all(1.0 <= t <= 16.0 for t in tau["per_prompt"])
    assert sum(tau["acceptance_histogram"]) > 0
    speedup = {int(n): v for n, v in report["expected_speedup"].items()}
    assert set(speedup) == set(range(2, 17)) and all(v > 0 for v in speedup.values())
    assert any("caps any drafter" in line for line in report["advice"])
    assert main(["--n-ctx", "1024", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("build ") and "t(n)/t(1)" in text and "advice " in text
    assert "devices " in text and " layers offloaded)" in text and "trees      verifiable" in text
    if not gpu_devices():
        assert "devices CPU;" in text and "on CPU (0/31 layers offloaded)" in text


@pytest.mark.parametrize("argv, needle", [
    (["--target", "/nonexistent.gguf"], "no such file"),
    (["--drafter", "d.gguf"], "--drafter needs --target"),
    (["--n-ctx", "4"], "argument --n-ctx: must be an integer >= 8"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and err[0].startswith("dflash-doctor: error:")


def test_a_file_that_is_not_a_drafter_is_one_line(tmp_path, embedded_target, capsys):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    assert main(["--target", str(embedded_target), "--drafter", str(junk), "--n-ctx", "256"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflash-doctor: error:")

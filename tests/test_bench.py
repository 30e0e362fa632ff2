"""dflash-bench on real parts: the embedded target, a reference-built drafter, real subprocesses.

Runs are tiny (two prompts, a few tokens): they check what the report contains, never how fast it is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_gguf.bench import kernels
from dflash_gguf.bench.cli import main
from dflash_gguf.bench.peers import PeerPrompt, llama_server
from dflash_gguf.bench.suite import builtin_suite_path, load_suite


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    """main()'s exit status (argparse's own errors exit through SystemExit) and what it printed."""
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_builtin_suite_covers_math_code_and_chat() -> None:
    prompts = load_suite()
    assert {p.category for p in prompts} == {"math", "code", "chat"}
    assert len({p.id for p in prompts}) == len(prompts)
    assert [p.category for p in load_suite(limit=1)] == ["math", "code", "chat"]
    assert {p.category for p in load_suite(categories=["code"])} == {"code"}
    assert builtin_suite_path().is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompts", "/nonexistent/prompts.jsonl"], "prompts file not found: /nonexistent/prompts.jsonl"),
        (["--categories", "poetry"], "no prompts in categories ['poetry']"),
        (["--repeats", "0"], "argument --repeats: expected a positive integer, got 0"),
        (["--peers", "llama-server"], "the llama-server peer needs --llama-server PATH"),
        (["--llama-server", "/nonexistent/llama-server"], "/nonexistent/llama-server: --llama-server is not a file"),
        (["--kernels", "--target", "/nonexistent/model.gguf"], "/nonexistent/model.gguf: no such file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, capsys, tmp_path) -> None:
    rc, _, err = run_cli(args + ["--out", str(tmp_path / "out")], capsys)
    assert rc == 2
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out" / "dflash-bench.json").exists()


def test_malformed_prompts_file_names_the_line(tmp_path, capsys) -> None:
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"id": "a", "category": "math", "prompt": "1+1?"}\n{"id": "b", "category": "math"\n')
    rc, _, err = run_cli(["--prompts", str(bad), "--out", str(tmp_path)], capsys)
    assert rc == 2
    assert f"{bad}:2: not valid JSON" in err and err.count("\n") == 1


def test_llama_server_that_never_starts_is_reported_unavailable(tmp_path, embedded_target) -> None:
    # a real binary that exits at once: the peer must notice, stop waiting and say why
    result = llama_server(
        Path("/bin/false"), embedded_target, embedded_target, [PeerPrompt("p", "hi", [1, 2])],
        max_tokens=4, repeats=1, n_threads=1, n_ctx=256, n_draft=3,
    )
    assert not result.available
    assert "exited with code 1 before it was ready" in result.reason


def test_requantize_refuses_unknown_types_before_libllama(tmp_path, embedded_target) -> None:
    with pytest.raises(ValueError, match="quantization must be one of Q4_0, Q8_0"):
        kernels.requantize(embedded_target, tmp_path / "x.gguf", "Q5_K")
    with pytest.raises(ValueError, match="not a GGUF file"):
        kernels.requantize(Path(__file__), tmp_path / "x.gguf", "Q8_0")
    assert list(tmp_path.iterdir()) == []


def test_kernel_measurement_reports_every_size(embedded_target) -> None:
    report = kernels.measure({"Q4_1 (as shipped)": embedded_target}, sizes=(1, 4), repeats=2, n_threads=2)
    data = report.to_dict()
    (variant,) = data["variants"]
    assert sorted(variant["seconds"]) == [1, 4] and all(len(v) == 2 for v in variant["seconds"].values())
    assert variant["ratio"][1] == 1.0 and variant["ratio"][4] > 0
    assert variant["argmax_agreement"] == 1.0  # the reference agrees with itself
    assert "CPU" in data["system_info"]
    table = kernels.to_markdown(report)
    assert "| Q4_1 (as shipped) |" in table and "t(4)/t(1)" in table


"""dflash-bench on real parts: the embedded target, a reference-built drafter, real subprocesses.

Runs are tiny (two prompts, a few tokens): they check what the report contains, never how fast it is.
"""

from __future__ import annotations

import json
import statistics
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
    assert {p.category for p in prompts} == {"math", "code", "chat", "copy-heavy", "json"}
    assert len({p.id for p in prompts}) == len(prompts)
    assert [p.category for p in load_suite(limit=1)] == ["math", "code", "chat", "copy-heavy", "json"]
    assert all(p.schema for p in load_suite(categories=["json"]))
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
        (["--modes", "tree", "--tree-nodes", "1"], "tree_nodes: must be 0 or in [2, "),
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


@pytest.mark.slow  # requantizes the target to Q8_0
def test_advice_only_for_weight_types_without_repacked_kernels(embedded_target, tmp_path) -> None:
    assert "Q8_0 requantization" in kernels.kernel_advice(embedded_target)
    q8 = kernels.requantize(embedded_target, tmp_path / "q8.gguf", "Q8_0")
    assert kernels.kernel_advice(q8) is None


@pytest.mark.slow  # times batches, teacher-forces built-in prompts three times, generates
def test_kernel_measurement_reports_every_size(embedded_target, dflash_gguf_path, monkeypatch) -> None:
    # the agreements teacher-force one built-in prompt per category, not all 30 (most of this test's time):
    # the same code over fewer rows
    agreement_texts = [p.prompt for p in load_suite(limit=1)]
    monkeypatch.setattr(kernels, "_agreement_texts", lambda: agreement_texts)
    report = kernels.measure(
        {"Q4_1 (as shipped)": embedded_target}, sizes=(1, 4), repeats=2, n_threads=2, generate_tokens=4,
        drafter=dflash_gguf_path,
    )
    data = report.to_dict()
    (variant,) = data["variants"]
    assert sorted(variant["seconds"]) == [1, 4] and all(len(v) == 2 for v in variant["seconds"].values())
    assert all(len(v) == 2 for v in variant["cpu_seconds"].values())
    assert variant["ratio"][1] == 1.0 and variant["ratio"][4] > 0 and variant["cpu_ratio"][4] > 0
    assert variant["argmax_agreement"] == 1.0  # the reference agrees with itself
    assert "CPU" in data["system_info"]
    # one round of greedy plain generation per built-in category (math, code, chat, copy-heavy, json)
    assert len(variant["plain_tokens_per_s"]) == 5 and variant["plain_tokens_per_s_median"] > 0
    assert variant["plain_cpu_ms_per_token_median"] > 0 and variant["step_alone_cpu_ms"] > 0
    assert 0.5 < data["flash_attn_flip_agreement"] <= 1.0
    assert sorted(data["drafter_cpu_ms"]) == [
        "draft block 16", "draft block 2", "draft block 4", "draft block 8", "inject 1 row(s)", "inject 8 row(s)"
    ]
    assert all(ms > 0 for ms in data["drafter_cpu_ms"].values())
    table = kernels.to_markdown(report)
    assert "| Q4_1 (as shipped) |" in table and "t(4)/t(1)" in table and "decode tok/s" in table



@pytest.mark.slow  # a whole bench run with three peers
def test_tiny_run_writes_json_markdown_and_plot(tmp_path, capsys, dflash_gguf_path) -> None:
    out = tmp_path / "results"
    rc, stdout, err = run_cli(
        [
            "--categories", "math", "code", "--limit", "1", "--max-tokens", "6", "--repeats", "2",
            "--threads", "2", "--drafter", str(dflash_gguf_path), "--out", str(out), "--name", "tiny",
            "--peers", "llama-cpp", "lookup", "reference",
        ],
        capsys,
    )
    assert rc == 0, err
    data = json.loads((out / "tiny.json").read_text())
    assert [p["category"] for p in data["prompts"]] == ["math", "code"]
    for p in data["prompts"]:
        assert {r["mode"] for r in p["runs"]} == {"plain", "dflash"}
        assert p["speedup"] > 0
        assert isinstance(p["outputs_identical"], bool)
        for mode in ("plain", "dflash"):
            s = p[mode]
            assert s["decode_tokens_per_s"] > 0 and s["ttft_s"] > 0 and s["prefill_s"] > 0
            assert s["verify_ms_per_cycle"] > 0 and 0 <= s["overhead_share"] < 1
            assert s["n_tokens"] >= 1
        assert p["dflash"]["tau"] >= 1.0
        assert isinstance(p["dflash"]["acceptance_histogram"], list)
    summary = data["summary"]
    assert set(summary) == {"all", "math", "code"}
    assert summary["all"]["prompts"] == 2 and summary["all"]["median_speedup"] > 0
    assert data["machine"]["backend"] == "CPU" and data["machine"]["n_threads"] == 2
    assert "is Q4_1: ggml has no repacked CPU kernels" in data["settings"]["advice"]
    assert data["machine"]["llama_cpp_python"] == "0.3.36"
    assert data["memory"]["peak_rss_final_mib"] > 50 and "ru_maxrss" in data["memory"]["memory_note"]
    assert data["memory"]["target_memory"] == "kv" and data["memory"]["n_rs_seq"] == 0
    assert data["settings"]["drafter_kind"] == "dflash" and data["settings"]["confidence_head"] is False
    for p in data["prompts"]:  # the speedup: the median of each repeat's DFlash loop rate over its plain one
        loop = {(r["mode"], r["repeat"]): r["loop_tokens_per_s"] for r in p["runs"]}
        ratios = [loop["dflash", k] / loop["plain", k] for k in range(2)]
        assert p["speedup"] == pytest.approx(statistics.median(ratios))
        assert [r["mode"] for r in p["runs"]] == ["plain", "dflash", "dflash", "plain"]  # A B, B A
        assert p["dflash"]["per_source"].keys() <= {"dflash"}
    peers = {p["name"]: p for p in data["peers"]}
    llama = peers["llama-cpp-python Llama (plain)"]
    assert llama["available"] and llama["overall"]["decode_tokens_per_s"] > 0
    assert llama["identical_to_plain"] == 2  # llama-cpp-python's own greedy loop: the bench's plain mode, token for token
    lookup = peers["llama-cpp-python LlamaPromptLookupDecoding"]
    assert lookup["available"] and lookup["overall"]["decode_tokens_per_s"] > 0
    assert lookup["identical_to_plain"] in (0, 1, 2)
    reference = peers["z-lab dflash_generate (reference)"]
    assert not reference["available"] and "--reference-drafter" in reference["reason"]

    markdown = (out / "tiny.md").read_text()
    assert "## Summary by category" in markdown and "| gsm8k_train-7467 | math |" in markdown
    assert "- goal: median speedup >= 1.5x on math and code: " in markdown
    assert "- goal: speedup >= 0.95x on every prompt: slowest " in markdown
    assert "unavailable — needs --reference-drafter" in markdown
    assert markdown in stdout

    import matplotlib.image

    png = out / "tiny.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(png).shape
    assert (width, height) == (1000, 400)
    assert sorted(f.name for f in out.iterdir()) == ["tiny.json", "tiny.md", "tiny.png"]  # no temp files left


def test_mode_summary_is_a_view_of_the_stats_model() -> None:
    """τ, the drafting-cycle histogram and acceptance by position come from one StatsBuilder over the runs' Steps."""
    from dflash_gguf.bench.results import Generation, mode_summary
    from dflash_gguf.steps import Step, StepKind

    def cycle(kind, drafted, accepted):
        return Step(kind=kind, tokens=[7] * (accepted + 1), text="", source="dflash" if drafted else None,
                    n_drafted=drafted, n_accepted=accepted, block_size=drafted + 1, cycle_s=0.01, verify_s=0.005)

    prefill = Step(kind=StepKind.PREFILL, tokens=[1], text="", verify_s=0.02)
    rejected = Generation("dflash", 0, [1, 7], 0.0, 0.0, 0.1, steps=[prefill, cycle(StepKind.DRAFT, 2, 0)])
    passed = Generation("dflash", 1, [1, 7, 7, 7, 7], 0.0, 0.0, 0.1,
                        steps=[prefill, cycle(StepKind.DRAFT, 2, 2), cycle(StepKind.PLAIN, 0, 0)])
    summary = mode_summary([rejected, passed])
    assert summary["acceptance_by_position"] == [0.5, 0.5]  # slot 2 was drafted twice and never reached once
    assert summary["acceptance_histogram"] == [1, 0, 1]  # drafting cycles only: the plain cycle is not a rejection
    assert summary["acceptance_rate"] == 0.5 and summary["tau"] == 5 / 3  # (1 + 3 + 1) tokens over 3 cycles
    assert summary["plain_cycle_share"] == 1 / 3 and summary["per_source"]["dflash"]["n_accepted"] == 2
    assert mode_summary([rejected])["acceptance_by_position"] == [0.0, 0.0]
    assert (rejected.tau, passed.tau, passed.cycles) == (1.0, 2.0, 2)


@pytest.mark.slow  # z-lab's reference in torch
def test_reference_peer_counts_tau_with_the_zlab_implementation(embedded_target, reference_checkpoint) -> None:
    from dflash_gguf.bench.peers import reference_tau
    from dflash_gguf.target import Target

    with Target.open(embedded_target, n_ctx=128, n_batch=64, n_threads=1) as target:
        tokens = target.vocab.tokenize("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", add_special=False)
    result = reference_tau(embedded_target, reference_checkpoint, [PeerPrompt("p", "", tokens)], max_tokens=4)
    assert result.available, result.reason
    (generation,) = result.runs["p"]
    assert generation.cycles >= 1 and generation.tau >= 1.0  # random weights: drafts rarely pass
    assert 1 <= generation.n_tokens <= 4
    missing = reference_tau(embedded_target, None, [], max_tokens=4)
    assert not missing.available and "--reference-drafter" in missing.reason


def test_mode_summary_counts_the_cycles_that_verified_trees() -> None:
    from dflash_gguf.bench.results import Generation, mode_summary
    from dflash_gguf.steps import Step, StepKind

    def cycle(drafted, accepted, nodes=0, branch=0):
        return Step(kind=StepKind.DRAFT, tokens=[7] * (accepted + 1), text="", source="dflash", n_drafted=drafted,
                    n_accepted=accepted, block_size=nodes or drafted + 1, tree_nodes=nodes, tree_branch=branch,
                    cycle_s=0.01, verify_s=0.005)

    prefill = Step(kind=StepKind.PREFILL, tokens=[1], text="", verify_s=0.02)
    run = Generation("tree", 0, [1] + [7] * 7, 0.0, 0.0, 0.1,
                     steps=[prefill, cycle(3, 2, nodes=8, branch=2), cycle(2, 1), cycle(4, 1, nodes=12)])
    summary = mode_summary([run])
    assert summary["tree_cycle_share"] == 2 / 3 and summary["tree_mean_rows"] == 10.0
    assert summary["tree_mean_depth"] == 1.5 and summary["tree_off_chain_share"] == 0.5
    assert mode_summary([Generation("dflash", 0, [1, 7], 0.0, 0.0, 0.1, steps=[prefill, cycle(2, 0)])])[
        "tree_mean_rows"] is None


@pytest.mark.slow  # a bench run in two modes (test_tree checks greedy trees against plain decoding quick)
def test_the_tree_mode_runs_in_lockstep_and_reports_its_trees(tmp_path, capsys) -> None:
    """--modes tree: DFlash on a Session opened for trees, beside plain; with a fixed block every drafting cycle
    verifies a tree of --tree-nodes rows (the forced shape), its output plain decoding's."""
    out = tmp_path / "results"
    rc, stdout, err = run_cli(["--prompts", str(_one_prompt(tmp_path)), "--max-tokens", "24", "--repeats", "1",
                               "--threads", "1", "--modes", "tree", "--tree-nodes", "8", "--block-size", "8",
                               "--out", str(out), "--name", "trees", "--no-warmup"], capsys)
    assert rc == 0, err
    data = json.loads((out / "trees.json").read_text())
    assert data["settings"]["modes"] == ["plain", "tree"] and data["settings"]["tree_nodes"] == 8
    tree = data["summary"]["all"]["modes"]["tree"]
    assert tree["outputs_identical"] == 1 and tree["tree_cycle_share"] > 0.5 and 2 < tree["tree_mean_rows"] <= 8
    assert "| tree |" in stdout and "cycles verifying a tree" in stdout


def test_copy_heavy_prompts_carry_their_sources() -> None:
    lines = [json.loads(line) for line in builtin_suite_path().read_text(encoding="utf-8").splitlines() if line.strip()]
    copy = [r for r in lines if r["category"] == "copy-heavy"]
    assert len(copy) >= 8
    assert all(r["source"] and r["from"] and r["license"] in ("MIT", "Apache-2.0", "CC BY 4.0") for r in copy)


def test_bad_modes_are_one_line(capsys) -> None:
    rc, _, err = run_cli(["--modes", "plain", "sideways"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # a bench run in four modes
def test_lookup_modes_run_interleaved_and_match_plain(tmp_path, capsys) -> None:
    out = tmp_path / "results"
    suite = [line for line in builtin_suite_path().read_text(encoding="utf-8").splitlines() if "self_instruct_seed-85" in line]
    prompts = tmp_path / "copy.jsonl"
    prompts.write_text(suite[0] + "\n", encoding="utf-8")  # the model re-emits place names from this paragraph
    rc, stdout, err = run_cli(
        ["--prompts", str(prompts), "--max-tokens", "24", "--repeats", "1", "--threads", "1",
         "--modes", "lookup", "dflash", "both", "--block-size", "8", "--out", str(out), "--name", "modes",
         "--no-warmup"],  # a fixed block: whether adaptive lookup pays is the measured costs' call
        capsys,
    )
    assert rc == 0, err
    data = json.loads((out / "modes.json").read_text())
    assert data["settings"]["modes"] == ["plain", "lookup", "dflash", "both"]
    (prompt,) = data["prompts"]
    assert {r["mode"] for r in prompt["runs"]} == {"plain", "lookup", "dflash", "both"}
    modes = data["summary"]["all"]["modes"]
    assert set(modes) == {"lookup", "dflash", "both"}
    assert modes["lookup"]["outputs_identical"] == 1 and modes["both"]["outputs_identical"] == 1
    assert modes["lookup"]["lookup_accepted"] > 0 and modes["lookup"]["draft_accepted"] == 0
    assert "lookup median" in stdout and "| copy-heavy | 1 |" in stdout


def _one_prompt(tmp_path: Path, text: str = "Say something about the sea.") -> Path:
    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"id": "sea", "category": "chat", "prompt": text}) + "\n", encoding="utf-8")
    return prompts


@pytest.mark.slow  # bench runs on the hybrid targets
@pytest.mark.parametrize("arch, mechanism", [("qwen35", "rs-snapshot"), ("qwen3next", "checkpoint")])
def test_bench_on_a_hybrid_target_reports_its_memory(hybrid_models, arch, mechanism, tmp_path, capsys) -> None:
    out = tmp_path / "results"
    rc, stdout, err = run_cli(
        ["--prompts", str(_one_prompt(tmp_path)), "--target", str(hybrid_models.target(arch)),
         "--drafter", str(hybrid_models.drafter(arch)), "--max-tokens", "8", "--repeats", "1", "--no-warmup",
         "--threads", "1", "--block-size", "4", "--out", str(out), "--name", "hybrid"],
        capsys,
    )
    assert rc == 0, err
    data = json.loads((out / "hybrid.json").read_text())
    memory = data["memory"]
    assert memory["target_memory"] == mechanism and memory["recurrent_state_bytes"] > 0
    assert (memory["n_rs_seq"] > 0) == (mechanism == "rs-snapshot")
    if mechanism == "rs-snapshot":  # the snapshot rows libllama allocates, at least
        assert memory["memory_extra_bytes_max"] >= memory["n_rs_seq"] * memory["recurrent_state_bytes"]
    else:  # the checkpoints held for the next turn
        assert memory["memory_extra_bytes_max"] > 0
    (prompt,) = data["prompts"]
    assert isinstance(prompt["outputs_identical"], bool)  # greedy equality on hybrids: test_hybrid_session (margins)
    assert all(r["stats"]["memory"] == mechanism for r in prompt["runs"])
    assert f"- target_memory: {mechanism}" in stdout and "- recurrent_state_bytes: " in stdout


@pytest.mark.slow  # kernel sweeps on the hybrid targets
@pytest.mark.parametrize("arch, mechanism", [("qwen35", "rs-snapshot"), ("qwen3next", "checkpoint")])
def test_kernel_sweep_on_a_hybrid_target(hybrid_models, arch, mechanism) -> None:
    report = kernels.measure({arch: hybrid_models.target(arch)}, sizes=(1, 4), repeats=1, n_threads=1,
                             generate_tokens=0, drafter=hybrid_models.drafter(arch))
    (variant,) = report.to_dict()["variants"]
    assert variant["memory"] == mechanism and variant["ratio"][4] > 0
    assert variant["rollback_ms_median"][4] > 0
    assert sorted(report.drafter_cpu_ms) == ["draft block 16", "draft block 2", "draft block 4", "draft block 8",
                                             "inject 1 row(s)", "inject 8 row(s)"]
    assert f"rolled back by {mechanism}" in kernels.to_markdown(report)


@pytest.mark.slow  # builds and converts a DSpark drafter, then a bench run
def test_bench_with_a_dspark_drafter_reports_its_confidence_head(embedded_target, tmp_path, capsys) -> None:
    from dflash_gguf.convert import convert_checkpoint
    from dspark_reference import make_dspark_checkpoint

    ck = make_dspark_checkpoint(tmp_path / "dspark", anchor_first=True, confidence=True, block_size=8)
    drafter = convert_checkpoint(ck, tmp_path / "dspark.gguf", target=embedded_target, progress=False)
    out = tmp_path / "results"
    rc, stdout, err = run_cli(
        ["--prompts", str(_one_prompt(tmp_path)), "--drafter", str(drafter), "--max-tokens", "12", "--repeats", "1",
         "--no-warmup", "--threads", "2", "--block-size", "4", "--out", str(out), "--name", "dspark"],
        capsys,
    )
    assert rc == 0, err
    data = json.loads((out / "dspark.json").read_text())
    assert data["settings"]["drafter_kind"] == "dspark" and data["settings"]["confidence_head"] is True
    conf = data["summary"]["all"]["dflash"]["confidence"]
    per_source = data["summary"]["all"]["dflash"]["per_source"]["dspark"]
    # every drafting cycle judges its first slot at least: as many judged slots as cycles, or more
    assert conf["slots"] >= per_source["cycles"] > 0
    assert 0.0 <= conf["predicted"] <= 1.0 and conf["observed"] == pytest.approx(
        per_source["n_accepted"] / conf["slots"])
    assert "Confidence head (dspark): mean predicted acceptance" in stdout

"""Property-based fuzzing of dflash-convert through its real command line, one process per case.

Each case is its own process (a forked child running the CLI's entry point, or with DFLASH_FUZZ_SPAWN=1
a fresh `python -m dflash_gguf.convert`). Families: config.json mutations (any key set to any JSON value, keys deleted, the whole file replaced,
deep nesting), safetensors header mutations (data_offsets shifted, into the header, overlapping,
three entries, floats, negative; dtypes and shapes changed; keys duplicated; the length prefix and the
file cut), and OUT naming one of the inputs (by path, symlink or hard link, with --force).

Pass: exit 0 with an output that passes the runtime's drafter check (dflash_gguf.drafter_gguf) and, for
header mutations, whose tensors equal what the safetensors library reads from the same file (so no
silent corruption), or exit 2 with exactly one stderr line and no output; in both cases no
temp file left and every input byte-identical. Fail: anything else (traceback, other exit code,
signal, hang past the timeout, changed input, leftover).

Budget: DFLASH_FUZZ_EXAMPLES (default 3) per test; the long run and its numbers: docs/RELIABILITY.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow  # hypothesis cases, each a dflash-convert in a fresh process

EXAMPLES = int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "3"))
REPORT = os.environ.get("DFLASH_FUZZ_REPORT")
CASE_TIMEOUT_S = 120

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, database=None, derandomize=EXAMPLES <= 20,
    suppress_health_check=list(HealthCheck),
)


def _digest(paths: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths if p.is_file()}


def report(family: str, outcome: str, detail: Any) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"family": family, "outcome": outcome, "detail": detail}, default=str) + "\n")


SPAWN = os.environ.get("DFLASH_FUZZ_SPAWN", "0") == "1" or not hasattr(os, "fork")
"""DFLASH_FUZZ_SPAWN=1 runs every case as `python -m dflash_gguf.convert`; by default each case is a forked
child of this process running the same entry point (`cli.main`, what the console script calls), which
isolates it as well (its own process: a crash or exit is its own) without paying Python's start-up per case."""


def convert(*args: str | Path, timeout: float = CASE_TIMEOUT_S) -> subprocess.CompletedProcess | None:
    argv = [*map(str, args), "--no-progress"]
    if SPAWN:
        try:
            return subprocess.run([sys.executable, "-m", "dflash_gguf.convert", *argv],
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
    return _forked(argv, timeout)


def _forked(argv: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    import tempfile

    from dflash_gguf.convert.cli import main

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: the CLI with its own stdout/stderr, its exit status is main()'s
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = os.fdopen(1, "w", closefd=False)
                sys.stderr = os.fdopen(2, "w", closefd=False)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                try:
                    code = main(argv)
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else 2
                except BaseException:
                    import traceback

                    traceback.print_exc()
                    code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = time.monotonic() + timeout
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.005)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, code, out.read(), err.read())


def leftovers(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.endswith(".tmp")]


def independent_tensors(ckpt: Path) -> dict[str, np.ndarray] | None:
    """GGUF name -> float32 values by the safetensors library, or None if it refuses the file."""
    import torch
    from safetensors.torch import load_file

    from dflash_gguf.schema import gguf_tensor_name

    try:
        out = {}
        for file in sorted(ckpt.glob("*.safetensors")):
            for name, t in load_file(file).items():
                out[gguf_tensor_name(name) or name] = t.to(torch.float32).numpy() if t.is_floating_point() else t.numpy()
        return out
    except Exception:  # noqa: BLE001 - the reference reader refusing is the fact we record
        return None


def judge(family: str, case: dict, ckpt: Path, out: Path, inputs: list[Path], before: dict[str, str],
          p: subprocess.CompletedProcess | None, *, check_values: bool = False, out_existed: bool = False,
          problems: list[str] | None = None) -> str:
    """Classify one run; assert it is one of the two good outcomes (and that `problems`, found by the caller, is empty)."""
    problems = list(problems or [])
    if p is None:
        outcome = "hang"
    elif "Traceback" in p.stderr:
        outcome = "traceback"
    elif p.returncode == 2:
        outcome = "refused"
        lines = p.stderr.strip().splitlines()
        if len(lines) != 1 or not lines[0].startswith("dflash-convert: error: "):
            problems.append(f"not one line: {p.stderr[-500:]!r}")
        if out.exists() and not out_existed:
            problems.append("output written on failure")
    elif p.returncode == 0:
        outcome = "converted"
        if not out.is_file():
            problems.append("exit 0 without output")
        else:
            problems += _runtime_refuses(out)
            if check_values:
                problems += _corruption(ckpt, out)
    else:
        outcome = "crash"
    if leftovers(out.parent) or leftovers(ckpt):
        problems.append(f"leftover temp files {leftovers(out.parent) + leftovers(ckpt)}")
    after = _digest(inputs)
    if after != before:
        problems.append("an input changed (data loss)")
    report(family, outcome if not problems else "bad:" + outcome, {**case, "problems": problems,
           "stderr": (p.stderr.strip().splitlines() or [""])[-1][:300] if p else ""})
    assert outcome in ("refused", "converted") and not problems, (outcome, problems, case, p.stderr[-1500:] if p else "")
    return outcome


def _runtime_refuses(out: Path) -> list[str]:
    """A converted drafter must pass the runtime's own pre-libllama check (else the converter wrote a file that aborts)."""
    from dflash_gguf.drafter_gguf import DrafterGGUFError, check_drafter_gguf

    try:
        check_drafter_gguf(out)
    except DrafterGGUFError as e:
        return [f"the converter wrote a drafter the runtime refuses: {e}"]
    return []


def _corruption(ckpt: Path, out: Path) -> list[str]:
    """A converted output must hold exactly what the safetensors library reads (and it must accept the file)."""
    from checkpoints import gguf_tensors

    expected = independent_tensors(ckpt)
    if expected is None:
        return ["converted a file the safetensors library refuses (silent corruption)"]
    written = gguf_tensors(out)
    problems = []
    for name, (_, got) in written.items():
        want = expected.get(name)
        if name == "d2t":
            continue
        if want is None or got.shape != want.shape or not np.allclose(got, want, rtol=2**-8, atol=0, equal_nan=True):
            problems.append(f"tensor {name} differs from the checkpoint (silent corruption)")
    return problems


@pytest.fixture()
def ckpt(reference_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(reference_checkpoint, tmp_path / "ckpt"))


# --- config.json -------------------------------------------------------------------------------------------------

CONFIG_KEYS = [
    "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "hidden_act",
    "rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor", "rope_is_neox_style",
    "use_sliding_window", "sliding_window", "layer_types", "is_causal", "draft_vocab_size", "num_target_layers",
    "dflash_config", "tie_word_embeddings", "rope_pct", "rope_percent",
]
DFLASH_KEYS = [
    "block_size", "mask_token_id", "target_layer_ids", "attention_value_scale", "output_multiplier",
    "final_logit_softcapping", "input_embedding_scale", "use_swa", "swa_window_size", "causal", "rms_norm_eps",
    "conv_kernel_size", "num_target_layers",
]
ROPE_KEYS = ["rope_theta", "partial_rotary_factor", "rope_type"]

SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, 1, 2, -1, 16, 29, 30, 49151, 49152, 576, 512, 513, 2**31, 2**32, 2**64, 10**400]),
    st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.5, 1.5, -0.0, 1e-300, 1e308]),
    st.text(max_size=8), st.sampled_from(["silu", "gelu", "relu", "DFlashDraftModel", "sliding_attention", "16", "vanilla",
                                          "gated", "DSparkSpeculator", "Gemma4DSparkModel", "LingDSparkModel"]),
)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)

CONFIG_MUTATION = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(CONFIG_KEYS), JSON),
    st.tuples(st.just("set_dflash"), st.sampled_from(DFLASH_KEYS), JSON),
    st.tuples(st.just("set_rope"), st.sampled_from(ROPE_KEYS), JSON),
    st.tuples(st.just("delete"), st.sampled_from(CONFIG_KEYS), st.none()),
    st.tuples(st.just("delete_dflash"), st.sampled_from(DFLASH_KEYS), st.none()),
    st.tuples(st.just("replace"), st.just("config"), JSON),
    st.tuples(st.just("raw"), st.sampled_from(["deep", "nan", "dup", "bom", "latin1", "empty"]), st.integers(1, 200000)),
)


_CONTAINERS = {"set_dflash": "dflash_config", "set_rope": "rope_parameters", "set_nested": "transformer_layer_config"}
"""Mutation ops that set a key inside a nested object (made an object first if it is not one)."""


def apply_config(path: Path, mutations: list) -> None:
    text = path.read_text()
    config = json.loads(text)
    raw = None
    for op, key, value in mutations:
        if not isinstance(config, dict) and op not in ("replace", "raw"):
            continue  # an earlier "replace" left no object to edit
        if op == "set":
            config[key] = value
        elif op in _CONTAINERS:
            if not isinstance(config.get(_CONTAINERS[op]), dict):
                config[_CONTAINERS[op]] = {}
            config[_CONTAINERS[op]][key] = value
        elif op == "delete":
            config.pop(key, None)
        elif op == "delete_dflash" and isinstance(config.get("dflash_config"), dict):
            config["dflash_config"].pop(key, None)
        elif op == "replace":
            config = value
        elif op == "raw":
            body = json.dumps(config if isinstance(config, dict) else {"config": config})
            raw = {
                "deep": ("[" * value) + ("]" * value),
                "nan": body.replace('"rms_norm_eps": 1e-05', '"rms_norm_eps": NaN'),
                "dup": body[:-1] + ', "hidden_size": 64}',
                "bom": "\ufeff" + body,
                "latin1": None,
                "empty": "",
            }[key]
            if key == "deep" and value % 2:
                raw = '{"dflash_config": ' + ('{"a": ' * value) + "1" + ("}" * value) + "}"
            if key == "latin1":
                path.write_bytes(body.encode()[:-1] + b', "x": "\xe9"}')
                return
    path.write_text(raw if raw is not None else json.dumps(config))


@FUZZ_SETTINGS
@given(mutations=st.lists(CONFIG_MUTATION, min_size=1, max_size=3))
def test_config_mutations_are_converted_or_refused_in_one_line(reference_checkpoint, tmp_path_factory, mutations):
    d = tmp_path_factory.mktemp("cfg")
    ckpt = Path(shutil.copytree(reference_checkpoint, d / "ckpt"))
    apply_config(ckpt / "config.json", mutations)
    out = d / "out" / "drafter.gguf"
    out.parent.mkdir()
    inputs = [ckpt / "config.json", ckpt / "model.safetensors"]
    before = _digest(inputs)
    judge("convert-config", {"mutations": repr(mutations)[:400]}, ckpt, out, inputs, before, convert(ckpt, out))


# --- DSpark config.json and mask_embedding.pt -----------------------------------------------------------------------

DSPARK_KEYS = [
    "transformer_layer_config", "aux_hidden_state_layer_ids", "sample_from_anchor", "markov_head_type", "markov_rank",
    "enable_confidence_head", "confidence_head_with_markov", "draft_vocab_size", "mask_token_id", "target_layer_ids",
    "block_size", "dflash_config", "architectures",
]
MASK_FILES = ["garbage", "payload", "wrong_id", "wrong_shape", "not_dict", "nan", "tensor_id", "valid"]
DSPARK_MUTATION = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(DSPARK_KEYS), JSON),
    st.tuples(st.just("set_nested"), st.sampled_from(DSPARK_KEYS + ["hidden_size", "num_hidden_layers", "rope_parameters"]), JSON),
    st.tuples(st.just("set_dflash"), st.sampled_from(DSPARK_KEYS + DFLASH_KEYS), JSON),
    st.tuples(st.just("delete"), st.sampled_from(DSPARK_KEYS), st.none()),
    st.tuples(st.just("mask_pt"), st.sampled_from(MASK_FILES), st.none()),
)


class _Payload:
    """Unpickled by plain pickle, this creates `marker`: the converter must never run it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def apply_dspark(ckpt: Path, mutations: list, marker: Path) -> None:
    import pickle

    import torch

    apply_config(ckpt / "config.json", [m for m in mutations if m[0] != "mask_pt"])
    for _, key, _ in (m for m in mutations if m[0] == "mask_pt"):
        pt = ckpt / "mask_embedding.pt"
        row = torch.randn(576)
        if key == "garbage":
            pt.write_bytes(b"\x80\x04not a pickle at all")
        elif key == "payload":
            pt.write_bytes(pickle.dumps({"mask_token_id": 16, "embedding": _Payload(marker)}))
        elif key == "not_dict":
            torch.save(row, pt)
        else:
            mask_id = {"wrong_id": 17, "tensor_id": torch.tensor(16)}.get(key, 16)
            row = {"wrong_shape": torch.randn(575), "nan": torch.full((576,), float("nan"))}.get(key, row)
            torch.save({"mask_token_id": mask_id, "embedding": row}, pt)


@pytest.fixture(scope="module")
def dspark_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Reference-built DSpark checkpoints in DeepSpec's schema (confidence head) and the speculators export's."""
    from dspark_reference import make_dspark_checkpoint

    d = tmp_path_factory.mktemp("dspark")
    return {"deepspec": make_dspark_checkpoint(d / "deepspec"),
            "speculators": make_dspark_checkpoint(d / "speculators", schema="speculators", confidence=False)}


@FUZZ_SETTINGS
@given(schema=st.sampled_from(["deepspec", "speculators"]), mutations=st.lists(DSPARK_MUTATION, min_size=1, max_size=3))
def test_dspark_config_and_mask_mutations_are_converted_or_refused(dspark_checkpoints, embedded_target, tmp_path_factory,
                                                                  schema, mutations):
    d = tmp_path_factory.mktemp("dspark-case")
    ckpt = Path(shutil.copytree(dspark_checkpoints[schema], d / "ckpt"))
    marker = d / "payload-ran"
    apply_dspark(ckpt, mutations, marker)
    out = d / "out" / "drafter.gguf"
    out.parent.mkdir()
    inputs = [ckpt / "config.json", ckpt / "model.safetensors", ckpt / "mask_embedding.pt", Path(embedded_target)]
    before = _digest(inputs)
    p = convert(ckpt, out, "--target", embedded_target)
    judge("convert-dspark", {"schema": schema, "mutations": repr(mutations)[:400]}, ckpt, out, inputs, before, p,
          problems=["mask_embedding.pt was unpickled with plain pickle (its payload ran)"] if marker.exists() else [])


# --- safetensors header ------------------------------------------------------------------------------------------

HEADER_MUTATION = st.one_of(
    st.tuples(st.just("offsets"), st.integers(0, 10**6),
              st.sampled_from(["shift", "into_header", "overlap", "three", "float", "negative", "swap", "end_past", "one", "strings"]),
              st.integers(-4096, 4096)),
    st.tuples(st.just("dtype"), st.integers(0, 10**6), st.sampled_from(["F32", "F16", "BF16", "I64", "I8", "U8", "BOOL", "F8_E4M3", "X", 7]), st.none()),
    st.tuples(st.just("shape"), st.integers(0, 10**6), st.sampled_from(["swap", "one_more", "zero", "negative", "float", "empty", "huge"]), st.none()),
    st.tuples(st.just("duplicate"), st.integers(0, 10**6), st.none(), st.none()),
    st.tuples(st.just("length"), st.none(), st.sampled_from(["+1", "-1", "huge", "zero", "file"]), st.none()),
    st.tuples(st.just("cut"), st.none(), st.floats(0.0, 1.0), st.none()),
    st.tuples(st.just("metadata"), st.none(), st.sampled_from(["list", "nested", "number"]), st.none()),
)


def apply_header(path: Path, mutations: list) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    names = sorted(k for k in header if k != "__metadata__")
    original = {k: list(header[k]["data_offsets"]) for k in names}  # later edits start from the real extents
    length_edit = cut = None
    dup = None
    for op, index, how, amount in mutations:
        name = names[index % len(names)] if index is not None else None
        entry = header.get(name) if name else None
        if op == "offsets":
            begin, end = original[name]
            other = original[names[(index + 1) % len(names)]]
            entry["data_offsets"] = {
                "shift": [begin + amount, end + amount],
                "into_header": [-(n // 2), -(n // 2) + (end - begin)],
                "overlap": [other[0], other[0] + (end - begin)],
                "three": [begin, end, end],
                "float": [float(begin), float(end)],
                "negative": [-1, end - begin - 1],
                "swap": [end, begin],
                "end_past": [begin, len(data) + abs(amount) + 1],
                "one": [begin],
                "strings": [str(begin), str(end)],
            }[how]
        elif op == "dtype":
            entry["dtype"] = how
        elif op == "shape":
            shape = [s for s in entry["shape"] if isinstance(s, int)]
            entry["shape"] = {
                "swap": shape[::-1], "one_more": shape + [1], "zero": [0] + shape[1:], "negative": [-1] + shape[1:],
                "float": [float(s) for s in shape], "empty": [], "huge": [2**62] + shape[1:],
            }[how]
        elif op == "duplicate":
            dup = name
        elif op == "length":
            length_edit = how
        elif op == "cut":
            cut = how
        elif op == "metadata":
            header["__metadata__"] = {"list": [1, 2], "nested": {"a": {"b": 1}}, "number": 3}[how]
    text = json.dumps(header, separators=(",", ":"))
    if dup is not None:
        entry_text = json.dumps({dup: header[dup]}, separators=(",", ":"))[1:-1]
        text = text[:-1] + "," + entry_text + "}"
    body = text.encode()
    body += b" " * ((8 - len(body) % 8) % 8)
    length = len(body)
    if length_edit is not None:
        length = {"+1": length + 1, "-1": length - 1, "huge": 2**63, "zero": 0, "file": len(body) + len(data)}[length_edit]
    blob = length.to_bytes(8, "little") + body + data
    if cut is not None:
        blob = blob[: int(len(blob) * cut)]
    path.write_bytes(blob)


@FUZZ_SETTINGS
@given(mutations=st.lists(HEADER_MUTATION, min_size=1, max_size=3))
def test_safetensors_header_mutations_never_corrupt_silently(reference_checkpoint, tmp_path_factory, mutations):
    d = tmp_path_factory.mktemp("st")
    ckpt = Path(shutil.copytree(reference_checkpoint, d / "ckpt"))
    apply_header(ckpt / "model.safetensors", mutations)
    out = d / "out" / "drafter.gguf"
    out.parent.mkdir()
    inputs = [ckpt / "config.json", ckpt / "model.safetensors"]
    before = _digest(inputs)
    judge("convert-safetensors", {"mutations": repr(mutations)[:400]}, ckpt, out, inputs, before,
          convert(ckpt / "model.safetensors", out), check_values=True)


# --- OUT is an input ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    """A metadata-only target GGUF with the embedded target's geometry (read in a fraction of a second)."""
    from checkpoints import HIDDEN_SIZE, NUM_TARGET_LAYERS, token_fields, write_metadata_gguf

    path = tmp_path_factory.mktemp("tgt") / "target.gguf"
    return write_metadata_gguf(path, "llama", n_embd=HIDDEN_SIZE, n_layer=NUM_TARGET_LAYERS,
                               fields=token_fields([f"t{i}" for i in range(49152)]))


@FUZZ_SETTINGS
@given(which=st.sampled_from(["target", "config", "safetensors", "index"]),
       how=st.sampled_from(["same", "symlink", "hardlink", "dotted", "symlinked_dir"]),
       force=st.booleans())
def test_out_naming_an_input_never_replaces_it(reference_checkpoint, small_target, tmp_path_factory, which, how, force):
    d = tmp_path_factory.mktemp("io")
    ckpt = Path(shutil.copytree(reference_checkpoint, d / "ckpt"))
    target = Path(shutil.copy(small_target, d / "target.gguf"))
    src: Path = ckpt
    if which == "index":
        index = ckpt / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": {"fc.weight": "model.safetensors"}}))
        src = index
    victim = {"target": target, "config": ckpt / "config.json", "safetensors": ckpt / "model.safetensors",
              "index": ckpt / "model.safetensors.index.json"}[which]
    if how == "same":
        out = victim
    elif how == "symlink":
        out = d / "link.gguf"
        out.symlink_to(victim)
    elif how == "hardlink":
        out = d / "hard.gguf"
        os.link(victim, out)
    elif how == "dotted":
        out = victim.parent / "." / ".." / victim.parent.name / victim.name
    else:
        (d / "alias").symlink_to(victim.parent)
        out = d / "alias" / victim.name
    inputs = [target, ckpt / "config.json", ckpt / "model.safetensors"] + ([src] if which == "index" else [])
    before = _digest(inputs)
    p = convert(src, out, "--target", target, *(["--force"] if force else []))
    outcome = judge("convert-out-is-input", {"which": which, "how": how, "force": force}, ckpt, out, inputs, before, p,
                    out_existed=True)
    assert outcome == "refused"


# --- signals -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_mid_conversion_leaves_no_temp_file(reference_checkpoint, tmp_path, signum):
    out = tmp_path / "drafter.gguf"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_gguf.convert", str(reference_checkpoint), str(out), "--outtype", "q8_0", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a background child otherwise ignores SIGINT
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".drafter.gguf.*.tmp")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, "the conversion finished before the temp file was seen"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    expected = 130 if signum == signal.SIGINT else 128 + signum
    assert proc.returncode == expected, (proc.returncode, err)
    assert len(err.strip().splitlines()) == 1 and "no output written" in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []

"""Property-based fuzzing of drafter GGUFs: mutated copies of real converted drafters, loaded by a Session.

Each case writes a mutated copy of a real drafter (full vocabulary, DFlash2, reduced vocabulary with
`d2t`): metadata keys set to values of any GGUF type, keys deleted, tensors dropped or re-typed,
`d2t` entries moved out of range, duplicated or stored as another dtype. A fresh Python process
then opens a `Session` on the embedded target with it and, if that succeeds, generates a few
tokens speculatively (so graph-time asserts are reached too). Pass: the process exits 0 having
either generated or refused the file with a ValueError that names it. Fail: a C abort or signal,
a traceback, or a hang (timeout).

Budget: DFLASH_FUZZ_EXAMPLES (default 3) per test; the long run and its numbers: docs/RELIABILITY.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_gguf.convert import convert_checkpoint
from dflash_gguf.target_gguf import FastGGUFReader, _field_value

pytestmark = pytest.mark.slow  # each mutated drafter is opened by a Session in a fresh process

EXAMPLES = int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "3"))
REPORT = os.environ.get("DFLASH_FUZZ_REPORT")  # a JSON-lines file each case's outcome is appended to
CASE_TIMEOUT_S = 180

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=EXAMPLES <= 20,  # the suite's small budget runs the same cases every time
    suppress_health_check=list(HealthCheck),
)

PROBE = textwrap.dedent(
    """
    import sys
    from dflash_gguf import Session
    from dflash_gguf.defaults import embedded_target
    path = sys.argv[1]
    try:
        session = Session(embedded_target(), path, n_ctx=256, n_threads=1)
    except ValueError as e:
        if path not in str(e):
            print("UNNAMED", type(e).__name__, e)
            sys.exit(3)
        print("REFUSED", type(e).__name__, str(e).replace(chr(10), " "))
        sys.exit(0)
    result = session.generate("Count: 1, 2, 3,", max_tokens=6, speculative=True)
    session.close()
    print("OK", len(result.text))
    """
)


@dataclass
class Base:
    name: str
    fields: list[tuple[str, Any, V, V | None]]
    tensors: list[tuple[str, np.ndarray, Q]]


def _read_base(name: str, path: Path) -> Base:
    r = FastGGUFReader(path)
    fields = [(k, *_field_value(f)) for k, f in r.fields.items() if not k.startswith("GGUF.")]
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in r.tensors]
    return Base(name, fields, tensors)


@pytest.fixture(scope="module")
def reduced_gguf_path(reference_checkpoint, embedded_target, tmp_path_factory) -> Path:
    """The reference checkpoint given a reduced draft vocabulary of 64 tokens (d2t + own head), converted."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from checkpoints import HIDDEN_SIZE

    d = Path(shutil.copytree(reference_checkpoint, tmp_path_factory.mktemp("reduced") / "ckpt"))
    config = json.loads((d / "config.json").read_text())
    config["draft_vocab_size"] = 64
    (d / "config.json").write_text(json.dumps(config))
    tensors = load_file(d / "model.safetensors")
    ids = torch.arange(0, 64 * 700, 700)
    tensors["d2t"] = (ids - torch.arange(64)).to(torch.int64)
    tensors["lm_head.weight"] = (torch.randn(64, HIDDEN_SIZE, generator=torch.Generator().manual_seed(1)) * 0.02).to(torch.bfloat16)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return convert_checkpoint(d, d.parent / "reduced.gguf", target=embedded_target, progress=False)


@pytest.fixture(scope="module")
def dspark_gguf_path(embedded_target, tmp_path_factory) -> Path:
    """A reference-built DSpark checkpoint (anchor-first, confidence head, Markov rank 32), converted."""
    from dspark_reference import make_dspark_checkpoint

    d = tmp_path_factory.mktemp("dspark")
    return convert_checkpoint(make_dspark_checkpoint(d / "ckpt"), d / "dspark.gguf", target=embedded_target, progress=False)


@pytest.fixture(scope="module")
def bases(dflash_gguf_path, dflash2_gguf_path, reduced_gguf_path, dspark_gguf_path) -> dict[str, Base]:
    return {
        "dflash": _read_base("dflash", dflash_gguf_path),
        "dflash2": _read_base("dflash2", dflash2_gguf_path),
        "reduced": _read_base("reduced", reduced_gguf_path),
        "dspark": _read_base("dspark", dspark_gguf_path),
    }


# --- mutations ---------------------------------------------------------------------------------------------------

DFLASH_KEYS = [
    "dflash.block_count", "dflash.context_length", "dflash.embedding_length", "dflash.feed_forward_length",
    "dflash.attention.head_count", "dflash.attention.head_count_kv", "dflash.attention.key_length",
    "dflash.attention.value_length", "dflash.attention.layer_norm_rms_epsilon", "dflash.attention.causal",
    "dflash.attention.sliding_window", "dflash.attention.sliding_window_pattern", "dflash.attention.value_scale",
    "dflash.attention.scale", "dflash.rope.freq_base", "dflash.rope.dimension_count", "dflash.rope.dimension_sections",
    "dflash.rope.scaling.type", "dflash.rope.scaling.factor", "dflash.hidden_activation", "dflash.embedding_scale",
    "dflash.logit_scale", "dflash.final_logit_softcapping", "dflash.target_layers", "dflash.block_size",
    "dflash.vocab_size", "dflash.conv_kernel_size", "dflash.conv_group_size", "dflash.selector_rank",
    "dflash.selector_top_k", "dflash.nextn_predict_layers", "dflash.expert_count", "dflash.expert_used_count",
    "dflash.sample_from_anchor", "dflash.has_confidence_head", "tokenizer.ggml.mask_token_id", "tokenizer.ggml.model",
    "dflash_gguf.target.fingerprint",
]

INTS = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 30, 31, 64, 511, 512, 513, 576, 49151, 49152, 2**31 - 1, 2**32 - 1]),
    st.integers(0, 2**32 - 1),
)
FLOATS = st.one_of(
    st.sampled_from([0.0, -0.0, -1.0, 1e-5, 1e-45, 1.0, 1e30, 3.4e38, float("nan"), float("inf"), float("-inf")]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
VALUES = st.one_of(  # arrays of >= 1 entry: gguf-py's writer cannot write an empty one
    st.tuples(INTS, st.just(V.UINT32), st.none()),
    st.tuples(st.integers(-(2**31), 2**31 - 1), st.just(V.INT32), st.none()),
    st.tuples(FLOATS, st.just(V.FLOAT32), st.none()),
    st.tuples(st.booleans(), st.just(V.BOOL), st.none()),
    st.tuples(st.sampled_from(["", "silu", "gelu", "relu", "yarn", "none", "gpt2", "x" * 300, "16"]), st.just(V.STRING), st.none()),
    st.tuples(st.lists(INTS, min_size=1, max_size=40), st.just(V.ARRAY), st.just(V.UINT32)),
    st.tuples(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=8), st.just(V.ARRAY), st.just(V.INT32)),
    st.tuples(st.lists(st.booleans(), min_size=1, max_size=600), st.just(V.ARRAY), st.just(V.BOOL)),
    st.tuples(st.lists(FLOATS, min_size=1, max_size=6), st.just(V.ARRAY), st.just(V.FLOAT32)),
    st.tuples(st.lists(st.sampled_from(["a", "b", ""]), min_size=1, max_size=6), st.just(V.ARRAY), st.just(V.STRING)),
)

MUTATION = st.one_of(
    st.tuples(st.just("set"), st.sampled_from(DFLASH_KEYS), VALUES),
    st.tuples(st.just("delete"), st.sampled_from(DFLASH_KEYS), st.none()),
    st.tuples(st.just("drop_tensor"), st.integers(0, 10**6), st.none()),
    st.tuples(st.just("retype_tensor"), st.integers(0, 10**6), st.sampled_from([Q.F16, Q.F32, Q.I32, Q.I64, Q.BF16])),
    st.tuples(st.just("d2t"), st.sampled_from(["out_of_range", "negative", "duplicate", "i32", "f32", "no_output", "huge"]), st.integers(0, 63)),
)


def _retype(data: np.ndarray, qtype: Q, new: Q, shape_ne: tuple[int, ...]) -> np.ndarray | None:
    """The tensor's values stored as `new` (None when the conversion does not apply)."""
    if qtype == Q.F32:
        values = data.astype(np.float32)
    elif qtype == Q.I64:
        values = data.astype(np.float64)
    elif qtype in (Q.BF16, Q.F16):
        values = gguf.quants.dequantize(data, qtype)
    else:
        return None
    if new == Q.F32:
        return values.astype(np.float32)
    if new == Q.F16:
        return values.astype(np.float16)
    if new == Q.I32:
        return values.astype(np.int32)
    if new == Q.I64:
        return values.astype(np.int64)
    if new == Q.BF16:
        return gguf.quants.quantize(values.astype(np.float32), Q.BF16)
    return None


def write_mutated(base: Base, mutations: list, path: Path) -> list[str]:
    """A copy of `base` with `mutations` applied; returns what was done, for the report."""
    fields = {k: (v, t, s) for k, v, t, s in base.fields}
    tensors = {n: (d, q) for n, d, q in base.tensors}
    done = []
    for op, what, arg in mutations:
        if op == "set":
            value, vtype, sub = arg
            fields[what] = (value, vtype, sub)
            done.append(f"set {what}={str(value)[:40]} as {vtype.name}{'/' + sub.name if sub else ''}")
        elif op == "delete":
            if fields.pop(what, None) is not None:
                done.append(f"delete {what}")
        elif op == "drop_tensor":
            name = sorted(tensors)[what % len(tensors)]
            del tensors[name]
            done.append(f"drop {name}")
        elif op == "retype_tensor":
            name = what if isinstance(what, str) else sorted(tensors)[what % len(tensors)]
            data, qtype = tensors[name]
            new = _retype(data, qtype, arg, ())
            if new is not None:
                tensors[name] = (new, arg)
                done.append(f"retype {name} {qtype.name}->{arg.name}")
        elif op == "d2t" and "d2t" in tensors:
            data, qtype = tensors["d2t"]
            ids = data.astype(np.int64).copy()
            if what == "out_of_range":
                ids[arg % ids.size] = 49152 + arg
            elif what == "huge":
                ids[arg % ids.size] = 2**40
            elif what == "negative":
                ids[arg % ids.size] = -1 - arg
            elif what == "duplicate":
                ids[arg % ids.size] = ids[(arg + 1) % ids.size]
            if what == "i32":
                tensors["d2t"] = (ids.astype(np.int32), Q.I32)
            elif what == "f32":
                tensors["d2t"] = (ids.astype(np.float32), Q.F32)
            elif what == "no_output":
                tensors.pop("output.weight", None)
            else:
                tensors["d2t"] = (ids, Q.I64)
            done.append(f"d2t {what} at {arg}")
    w = gguf.GGUFWriter(path, "dflash")
    for key, (value, vtype, sub) in fields.items():
        if key == "general.architecture":
            continue
        w.add_key_value(key, value, vtype, sub)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return done


def run_probe(path: Path) -> tuple[str, subprocess.CompletedProcess | None]:
    """('ok' | 'refused' | 'crash' | 'traceback' | 'unnamed' | 'hang', the process)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        p = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True,
                           timeout=CASE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return "hang", None
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    if "Traceback" in p.stderr:
        return "traceback", p
    if p.returncode == 3:
        return "unnamed", p
    if p.returncode != 0:
        return "crash", p
    return ("ok" if last.startswith("OK") else "refused" if last.startswith("REFUSED") else "crash"), p


def report(family: str, outcome: str, detail: Any) -> None:
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(json.dumps({"family": family, "outcome": outcome, "detail": detail}) + "\n")


def check_case(base: Base, mutations: list, tmp: Path) -> None:
    path = tmp / f"mutated-{base.name}.gguf"
    done = write_mutated(base, mutations, path)
    before = path.read_bytes()
    outcome, p = run_probe(path)
    line = p.stdout.strip().splitlines()[-1] if p is not None and p.stdout.strip() else ""
    report(f"gguf-{base.name}", outcome, {"mutations": done, "line": line[:300]})
    assert path.read_bytes() == before, "the drafter file was modified"
    assert outcome in ("ok", "refused"), (outcome, done, p.returncode if p else None, (p.stderr[-2000:] if p else ""))


@FUZZ_SETTINGS
@given(data=st.data())
def test_mutated_drafter_gguf_never_crashes_a_session(bases, tmp_path_factory, data):
    base = bases[data.draw(st.sampled_from(sorted(bases)), label="base")]
    mutations = data.draw(st.lists(MUTATION, min_size=1, max_size=3), label="mutations")
    check_case(base, mutations, tmp_path_factory.mktemp("case"))


# The probe's own families, fixed: each libllama abort the issue names, so the suite proves them every run.
NAMED = [
    ("dflash", [("set", "dflash.block_count", (0, V.UINT32, None))]),
    ("dflash", [("set", "dflash.block_count", (100000, V.UINT32, None))]),
    ("dflash", [("set", "dflash.attention.layer_norm_rms_epsilon", (-1e-5, V.FLOAT32, None))]),
    ("dflash", [("set", "dflash.attention.layer_norm_rms_epsilon", (float("nan"), V.FLOAT32, None))]),
    ("reduced", [("d2t", "out_of_range", 3)]),
    ("reduced", [("d2t", "negative", 3)]),
    ("reduced", [("d2t", "i32", 0)]),
    ("reduced", [("d2t", "no_output", 0)]),
    ("dflash", [("retype_tensor", "blk.0.ffn_down.weight", Q.I32)]),  # segfaulted in mul_mat
    ("dflash", [("retype_tensor", "blk.0.attn_norm.weight", Q.F16)]),  # aborted in the norm
    ("dspark", [("retype_tensor", "markov_w1.weight", Q.I32)]),  # the Markov head's get_rows / mul_mat
    ("dspark", [("set", "dflash.block_size", (0, V.UINT32, None))]),  # build_dspark_markov_head asserts it
]


@pytest.mark.parametrize("base_name, mutations", NAMED, ids=[f"{b}-{m[0][1]}-{m[0][2] if m[0][0] != 'set' else m[0][2][0]}" for b, m in NAMED])
def test_named_aborts_are_refused_with_the_file_and_field(bases, tmp_path, base_name, mutations):
    path = tmp_path / "mutated.gguf"
    write_mutated(bases[base_name], mutations, path)
    outcome, p = run_probe(path)
    assert outcome == "refused", (outcome, p.stdout[-500:] if p else "", p.stderr[-1500:] if p else "")
    field = {"set": mutations[0][1], "retype_tensor": mutations[0][1]}.get(mutations[0][0], "d2t")
    assert field in p.stdout, p.stdout

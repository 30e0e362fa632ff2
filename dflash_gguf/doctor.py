"""`dflash-doctor`: whether speculation will pay on this machine with this pair, measured, with the advice that follows.

It reports the libllama build (backends, the layer-input API DFlash needs), the pair (architecture,
fingerprint, drafter kind, block size, recurrent-state snapshots), the target's measured cost curve t(n)/t(1)
on this device, the ceiling it puts on any drafter at each block size (n tokens for the price of t(n)), the
drafter's τ on a few built-in prompts, and the speedup those two give together. Text by default, --json for
tools. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from .backends import GPU_KINDS, Device, build
from .cli_parser import DRAFTER_HELP, EXIT_BAD_INPUT, OneLineParser
from .config import KV_CACHE_SETTINGS, SessionOptions, add_arguments, from_arguments
from .llama_ext import MissingSymbolError, layer_input_api_present
from .tree import branching_refused

PROG = "dflash-doctor"
SESSION = ("n_ctx", "n_gpu_layers", "n_gpu_layers_draft", "n_threads", *KV_CACHE_SETTINGS)
# one prompt per kind of work the drafter meets; τ at the drafter's own block, greedy
PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me three tips for sleeping better.",
)
MAX_TOKENS = 64


def diagnose(target: Path | None, drafter: Path | None, options: SessionOptions) -> dict[str, Any]:
    """Every figure the report shows, measured now on this machine."""
    from .session import Session
    from .timing import calibrate

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    report: dict[str, Any] = {"machine": {"cpu_count": os.cpu_count(), "load_average": load},
                              "build": {**build(), "layer_input_api": layer_input_api_present()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no drafter" and similar: the report says it in its own words
        session = Session(target, drafter, options)
    with session:
        t = session.target
        report["pair"] = {
            "target": str(t.path), "architecture": t.architecture, "fingerprint": t.fingerprint(),
            "n_gpu_layers": t.n_gpu_layers, "target_placement": session.placement.as_dict(),
            "drafter": None if session.drafter is None else str(session.drafter.path),
            "speculation_off_because": session.speculative_disabled_reason,
            "sources": _sources(session),
            # the MTP heads that draft: how many, how they are driven (one, chained, shared-memory), their file
            "mtp": None if session.speculative_disabled_reason or session._mtp is None else session._mtp.described(),
            # whether cycles may verify draft trees (tree_nodes): speculation, and memory that can branch
            "trees_off_because": session.speculative_disabled_reason or branching_refused(t, session.memory),
        }
        if session.drafter is None:
            report["advice"] = advice(report)
            return report
        d = session.drafter
        report["pair"].update(kind=d.kind, block_size=d.block_size, n_gpu_layers_draft=d.n_gpu_layers,
                              drafter_placement=session.drafter_placement.as_dict(),
                              n_rs_seq=t.n_rs_seq, rollback=session.memory.name)
        block = min(d.block_size, t.n_batch, t.n_ctx_seq - 1)
        costs = calibrate(t, d, memory=session.memory, max_block=block)
        t1 = costs.target.seconds(1)
        relative = {n: costs.target.seconds(n) / t1 for n in range(1, block + 1)}
        report["costs"] = {"plain_step_ms": t1 * 1e3, "verify_relative": relative,
                           "draft_pass_ms": costs.draft.seconds(block) * 1e3}
        report["ceiling"] = {n: n / relative[n] for n in relative}
        taus, histogram = [], [0] * block
        for prompt in PROMPTS:
            r = session.chat([{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, block_size=block)
            taus.append(r.stats.acceptance_length)
            for k, count in enumerate(r.stats.acceptance_histogram[:block]):
                histogram[k] += count
        report["tau"] = {"block_size": block, "per_prompt": taus, "mean": sum(taus) / len(taus),
                         "acceptance_histogram": histogram}
        # a block of n keeps min(k, n - 1) of the k drafts the block of `block` accepted, plus the bonus token
        cycles = sum(histogram) or 1
        report["expected_speedup"] = {
            n: (1 + sum(h * min(k, n - 1) for k, h in enumerate(histogram)) / cycles) * t1
            / (costs.target.seconds(n) + costs.draft.seconds(n))
            for n in range(2, block + 1)
        }
    report["advice"] = advice(report)
    return report


def _sources(session: Any) -> list[str]:
    """The draft sources the Session's policy chooses among, by the names its stats use."""
    if session.speculative_disabled_reason is not None:
        return []
    return (["lookup"] if session.lookup else []) + (["mtp"] if session.mtp else []) + \
        ([session.drafter.kind] if session.drafter is not None else [])


def advice(report: dict[str, Any]) -> list[str]:
    """What the figures say to do, one line each."""
    pair, out = report["pair"], []
    gpu = [d["name"] for d in report["build"]["devices"] if d["kind"] in GPU_KINDS]
    target_on = pair["target_placement"]
    if pair.get("speculation_off_because"):
        out.append(f"speculation is off for this target: {pair['speculation_off_because']}")
    if pair["drafter"] is None:
        if pair["mtp"] is not None:
            whose = "the target's own MTP heads" if pair["mtp"]["file"] is None else "the MTP heads given as --drafter"
            beside = ", beside lookup (copies from the context)" if "lookup" in pair["sources"] else ""
            out.append(f"no drafter: {whose} draft{beside}; --drafter FILE.gguf with a DFlash drafter adds one")
        else:
            out.append("no drafter: only lookup drafts (copies from the context); --drafter FILE adds one")
        return out
    if gpu and not target_on["devices"]:
        out.append(f"a GPU is there ({', '.join(gpu)}) but the target runs on the CPU: --n-gpu-layers -1")
    elif target_on["devices"] and pair["drafter_placement"]["backend"] != target_on["backend"]:
        out.append(f"the drafter runs on {pair['drafter_placement']['device']}, apart from the target "
                   f"({target_on['device']}): every cycle copies features between them; --n-gpu-layers-draft -1")
    ceiling, speedup = report["ceiling"], report["expected_speedup"]
    best = max(ceiling, key=ceiling.get)
    out.append(f"the verify cost caps any drafter at {ceiling[best]:.2f}x, reached at block {best}")
    pick = max(speedup, key=speedup.get)
    if speedup[pick] >= 1.05:
        out.append(f"with this drafter's measured acceptance, block {pick} pays most: {speedup[pick]:.2f}x expected; "
                   "the adaptive controller (the default) finds it per cycle, --block-size fixes it")
    else:
        out.append(f"with this drafter's measured acceptance no block pays (best: block {pick}, {speedup[pick]:.2f}x); "
                   "the adaptive controller will mostly decode plainly, which costs nothing")
    if not gpu and ceiling[best] < 2:
        out.append("CPU verification is compute-bound: a batch costs nearly its tokens' single steps; "
                   "`dflash-bench --kernels` measures whether a Q8_0 or Q4_0 requantization of the target "
                   "verifies cheaper on this CPU")
    return out


def to_text(report: dict[str, Any]) -> str:
    build, pair = report["build"], report["pair"]
    devices = ", ".join(Device(**d).label for d in build["devices"])
    lines = [f"build      llama-cpp-python {build['llama_cpp_python']}; backends {build['backends']}; "
             f"devices {devices}; layer-input API {'present' if build.get('layer_input_api') else 'missing'}",
             f"target     {pair['target']} ({pair['architecture']}, fingerprint {pair['fingerprint'][:16]}) "
             f"on {_where(pair['target_placement'])}",
             f"sources    {', '.join(pair['sources']) or 'none (plain decoding)'}",
             *([f"mtp        {_heads(pair['mtp'])}"] if pair.get("mtp") else []),
             f"trees      {'off: ' + pair['trees_off_because'] if pair['trees_off_because'] else 'verifiable (tree_nodes)'}"]
    if pair["drafter"] is not None:
        lines.append(f"drafter    {pair['drafter']} ({pair['kind']}, block {pair['block_size']}; rollback "
                     f"{pair['rollback']}, n_rs_seq {pair['n_rs_seq']}) on {_where(pair['drafter_placement'])}")
        costs = report["costs"]
        lines.append(f"costs      plain step {costs['plain_step_ms']:.2f} ms; draft pass {costs['draft_pass_ms']:.2f} ms")
        lines.append("block      " + " ".join(f"{n:>5}" for n in costs["verify_relative"]))
        lines.append("t(n)/t(1)  " + " ".join(f"{v:5.2f}" for v in costs["verify_relative"].values()))
        lines.append("ceiling    " + " ".join(f"{v:5.2f}" for v in report["ceiling"].values()))
        tau = report["tau"]
        lines.append(f"τ          {tau['mean']:.2f} at block {tau['block_size']} over {len(tau['per_prompt'])} "
                     f"built-in prompts ({', '.join(f'{v:.2f}' for v in tau['per_prompt'])})")
        # block 1 is plain decoding itself: no speedup to expect, so no figure
        lines.append("speedup    " + " ".join(["    —"] + [f"{v:5.2f}" for v in report["expected_speedup"].values()])
                     + "   expected at each block: E[committed]·t(1) / (t(n) + draft pass)")
    lines += [f"advice     {line}" for line in report["advice"]]
    machine = report["machine"]
    if machine["load_average"] is not None and machine["load_average"] > 0.5 * (machine["cpu_count"] or 1):
        lines.append(f"note       load average {machine['load_average']:.1f} on {machine['cpu_count']} cores while "
                     "measuring: other work disturbed these timings; rerun on a quieter machine")
    return "\n".join(lines) + "\n"


def _heads(mtp: dict[str, Any]) -> str:
    """The MTP heads in words: how many, how driven, whose."""
    n = mtp["heads"]
    how = {"one": "1 head, chained on its own output",
           "chained": f"{n} chained heads (head i drafts token i + 1)",
           "shared-memory": f"{n} heads in one graph, reading the target's KV"}[mtp["layout"]]
    whose = "the target's own" if mtp["file"] is None else f"from {mtp['file']}"
    return f"{how}, at most {mtp['max_draft']} drafts a cycle; {whose}"


def _where(placement: dict[str, Any]) -> str:
    return f"{placement['device']} ({placement['layers_offloaded']} layers offloaded)"


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", type=Path, help=DRAFTER_HELP)
    p.add_argument("--json", action="store_true", help="the report as JSON, for tools")
    add_arguments(p, SessionOptions, SESSION)
    a = p.parse_args(argv)
    options = from_arguments(p, SessionOptions, a, SESSION)
    if a.drafter is not None and a.target is None:
        p.error("--drafter needs --target: the embedded drafter belongs to the embedded target")
    for flag, path in (("--target", a.target), ("--drafter", a.drafter)):
        if path is not None and not path.is_file():
            p.error(f"{flag} {path}: no such file")
    try:
        report = diagnose(a.target, a.drafter, options)
    except MissingSymbolError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"{PROG}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sys.stdout.write(json.dumps(report, indent=1) + "\n" if a.json else to_text(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What batching across slots gives where a decode's cost is another device's: a projection (issue 37).

scripts/bench_batching.py measures the servers on this CPU. Where a batch of rows costs about what one row
costs (a GPU), the same requests decode differently, and no GPU is lent here. So this replays the bench's
workload, step by step, under a cost curve t(rows) for one decode of that many rows (one row per sequence):
the bench's prompts at each concurrency C, started together, each ending after the tokens the embedded
target really gives it (greedy, --max-tokens; measured here with a Session), and prices every decode step
of the active sequences four ways:

  per-slot   a context per slot on one device: each active sequence's row is a decode of its own, one after
             another (a device runs one graph at a time)
  stream     one context, a KV stream per sequence (dflash-serve's layout): libllama decodes one pass per
             run of consecutive sequence ids, each pass priced t(its rows)
  filled     the same, with gaps between runs filled as the shared context fills them: its own fit of
             seconds = a * passes + b * rows, learned from the steps priced so far (batching.PassCosts)
  unified    one KV cache for all sequences (llama-server's layout when it sizes its slots itself): every
             active row in one pass; not bit for bit a sequence's replies alone (docs/DESIGN.md)

Prefill is left out (the same in every layout but per-slot, where it is C separate prompt decodes). The figures
are a projection: tok/s is completion tokens over the priced seconds, "x one at a time" divides C's by
C = 1's. With the curve measured on this CPU (scripts/measure_batched_decode.py --json) the projection can be
set against the bench's measured figures.

    python scripts/project_batching.py --curve scripts/verify_curves/batched_bench_llama7b_f16.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from load_test_server import PROMPTS  # noqa: E402

from dflash_gguf.batching import PassCosts  # noqa: E402

LAYOUTS = ("per-slot", "stream", "filled", "unified")


def curve_from(path: Path) -> tuple[str, Callable[[int], float]]:
    """(label, t) where t(rows) interpolates the curve's points linearly (and extrapolates its last slope)."""
    data = json.loads(path.read_text())
    points = sorted((int(k), float(v)) for k, v in data["seconds"].items())
    rows = np.array([p[0] for p in points], dtype=float)
    secs = np.array([p[1] for p in points])
    slope = (secs[-1] - secs[-2]) / (rows[-1] - rows[-2]) if len(points) > 1 else secs[0]

    def t(n: int) -> float:
        if n <= rows[-1]:
            return float(np.interp(n, rows, secs))
        return float(secs[-1] + slope * (n - rows[-1]))

    return data.get("label", path.name), t


def reply_lengths(prompts: list[str], max_tokens: int) -> dict[str, int]:
    """Completion tokens each prompt really gets from the embedded target (greedy), as the bench sends it."""
    from dflash_gguf import Session

    with Session(None, None, n_ctx=1024) as s:
        out = {}
        for p in prompts:
            out[p] = len(s.chat([{"role": "user", "content": p}], max_tokens=max_tokens, temperature=0,
                                speculative=False).tokens)
            s.reset()
        return out


def runs(ids: list[int]) -> list[int]:
    """Lengths of the runs of consecutive ids (sorted)."""
    out = [1]
    for a, b in zip(ids, ids[1:]):
        if b == a + 1:
            out[-1] += 1
        else:
            out.append(1)
    return out


def priced_step(active: list[int], t: Callable[[int], float], passes: PassCosts) -> dict[str, float]:
    """Seconds of one decode step of these sequence ids (one row each), per layout; `passes` learns the step
    as the shared context would (its filled batch, or its runs)."""
    ids = sorted(active)
    stream = sum(t(r) for r in runs(ids))
    fillers = [g for a, b in zip(ids, ids[1:]) for g in range(a + 1, b) if passes.fill_pays(b - a - 1)]
    filled_ids = sorted(ids + fillers)
    filled = sum(t(r) for r in runs(filled_ids))
    passes.observe(filled_ids, 1, filled)
    return {"per-slot": len(ids) * t(1), "stream": stream, "filled": filled, "unified": t(len(ids))}


def project(lengths: list[list[int]], t: Callable[[int], float]) -> dict[str, tuple[int, float]]:
    """(tokens, seconds) per layout over rounds of requests started together (slot i serves request i)."""
    passes = PassCosts()
    seconds = dict.fromkeys(LAYOUTS, 0.0)
    tokens = 0
    for round_lengths in lengths:
        tokens += sum(round_lengths)
        for step in range(max(round_lengths)):
            active = [i for i, n in enumerate(round_lengths) if n > step]
            for layout, s in priced_step(active, t, passes).items():
                seconds[layout] += s
    return {layout: (tokens, seconds[layout]) for layout in LAYOUTS}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--curve", type=Path, required=True, help="JSON {label, seconds: {rows: seconds per decode}}")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    if not a.curve.is_file():
        p.error(f"--curve {a.curve}: no such file")
    try:
        label, t = curve_from(a.curve)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        p.error(f"--curve {a.curve}: not a cost curve ({e})")
    levels = [int(c) for c in a.concurrency.split(",")]
    if levels[0] != 1 or a.rounds < 1 or a.max_tokens < 1:
        p.error("--concurrency must start with 1; --rounds and --max-tokens must be >= 1")
    # the prompts each level sends, as scripts/bench_batching.py sends them
    plan = {c: [[PROMPTS[(r * c + i) % len(PROMPTS)] for i in range(c)] for r in range(a.rounds)] for c in levels}
    lengths = reply_lengths(sorted({q for rounds in plan.values() for rnd in rounds for q in rnd}), a.max_tokens)
    print(f"PROJECTION under {label} ({a.curve.name}); reply lengths from the embedded target, greedy, "
          f"--max-tokens {a.max_tokens}; decode steps only, no prefill")
    out = {"curve": str(a.curve), "label": label, "max_tokens": a.max_tokens, "rounds": a.rounds, "levels": {}}
    for c in levels:
        priced = project([[lengths[q] for q in rnd] for rnd in plan[c]], t)
        out["levels"][c] = {layout: n / s for layout, (n, s) in priced.items()}
    print("\n| layout | " + " | ".join(f"c={c} tok/s" for c in levels) + f" | c={levels[-1]} x one at a time |")
    print("|---|" + "---|" * (len(levels) + 1))
    for layout in LAYOUTS:
        cells = " | ".join(f"{out['levels'][c][layout]:.1f}" for c in levels)
        ratio = out["levels"][levels[-1]][layout] / out["levels"][1][layout]
        print(f"| {layout} | {cells} | {ratio:.2f}x |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

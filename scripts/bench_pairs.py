"""Read a dflash-bench JSON run by run: every repeat's DFlash/plain ratio (the bench's per-prompt speedup is
their median), and, given the target, how close to a tie the target was where a DFlash output first left the
plain one.

    python scripts/bench_pairs.py BENCH.json [--target T.gguf]

Paired ratios cancel drifts slower than one pair of runs, which per-mode medians do not. The tie check
re-decodes the plain output's prefix up to the first difference and prints the target's top-two logit gap
there (docs/BENCHMARKS.md: recurrent kernels are not batch-invariant, so a verify batch may flip a near tie).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np


def paired_ratios(prompt: dict) -> list[float]:
    """Each repeat's DFlash loop rate over the plain one of the same repeat, as the bench pairs them."""
    rates = {(r["mode"], r["repeat"]): r["loop_tokens_per_s"] for r in prompt["runs"]}
    return [rate / rates["plain", k] for (mode, k), rate in rates.items() if mode == "dflash"]


def first_difference(prompt: dict) -> tuple[list[int], int, int] | None:
    """(plain tokens, index of the first difference, the DFlash token there) for the first DFlash run that differs."""
    plain = next(r["tokens"] for r in prompt["runs"] if r["mode"] == "plain")
    for run in prompt["runs"]:
        if run["mode"] == "dflash" and run["tokens"] != plain:
            i = next(k for k, (a, b) in enumerate(zip(plain, run["tokens"])) if a != b)
            return plain, i, run["tokens"][i]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench_pairs.py")
    parser.add_argument("bench", type=Path, help="a dflash-bench JSON (plain and dflash modes)")
    parser.add_argument("--target", type=Path, help="the bench's target: check each first difference for a near tie")
    args = parser.parse_args()
    data = json.loads(args.bench.read_text(encoding="utf-8"))
    prompts = data["prompts"]
    every = []
    for p in prompts:
        ratios = paired_ratios(p)
        every += ratios
        print(f"{p['id']:<28} paired median {statistics.median(ratios):.3f}  ({', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"all prompts: median of {len(every)} paired ratios {statistics.median(every):.3f}")
    if args.target is None:
        return

    from dflash_gguf import Session
    from dflash_gguf.chat import ChatRequest
    from dflash_gguf.bench.suite import load_suite

    texts = {p.id: p.prompt for p in load_suite()}
    with Session(args.target, n_ctx=data["settings"]["n_ctx"], n_threads=1) as session:
        for p in prompts:
            found = first_difference(p)
            if found is None:
                continue
            plain, i, other = found
            if p["id"] not in texts:
                print(f"{p['id']}: not in the built-in suite; its prompt text is not in the JSON, skipped")
                continue
            prompt = session.prepare_chat(ChatRequest([{"role": "user", "content": texts[p["id"]]}])).tokens
            session.reset()
            session.target.decode(prompt + plain[:i], 0, logits="last")
            row = session.target.output_logits()[-1]
            top = np.argsort(row)[::-1][:2]
            print(f"{p['id']}: first difference at token {i}: plain {plain[i]}, DFlash {other}; top two {top.tolist()}, "
                  f"gap {row[top[0]] - row[top[1]]:.4f}")


if __name__ == "__main__":
    main()

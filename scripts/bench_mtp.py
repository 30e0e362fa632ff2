"""Lockstep figures for MTP drafting on the random-head fixture: plain decoding against MTP, and MTP + lookup.

A random head accepts nearly nothing and no real MTP model is reachable here, so this measures what the
policy's back-off costs (the goal is >= 0.95x of plain), never a speedup. Every mode runs on the same GGUF
(its own Session, opened with the same options), so their weights are the same mapped pages: a baseline on
another file (the trunk converted without its head) read ~15% faster per target step in lockstep, its
pages shared with the control's and warm in the CPU's caches. "plain" decodes plainly with the heads not
loaded (SessionOptions.mtp off); "plain again" is a second such Session, the control. Every mode is advanced
one cycle each in turn (bench.runner.lockstep_generations), the turn order reversed every other repeat.
The last column is steadier than the ratios on a loaded machine: per plain cycle, the median time spent
outside the target's decode (`Step.cycle_s - Step.verify_s`: the loop, the policy and every source's share).

    python scripts/bench_mtp.py [--dir /tmp/mtp-fixture] [--repeats 3] [--max-tokens 128]
(builds the fixture into --dir on first use)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from dflash_gguf import Session
from dflash_gguf.bench.runner import BenchConfig, lockstep_generations
from dflash_gguf.config import GenerationConfig, SessionOptions
from dflash_gguf.lockstep import order
from dflash_gguf.steps import StepKind

PROMPTS = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "List three uses of a paperclip, then explain the second one."}],
    [{"role": "user", "content": "def fib(n):\n    # complete this function\n"}],
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/mtp-fixture"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from mtp_fixtures import build_mtp_target

    from dflash_gguf.defaults import embedded_target

    args.dir.mkdir(parents=True, exist_ok=True)
    target = args.dir / "qwen35-mtp.gguf"
    if not target.exists():
        build_mtp_target(args.dir, embedded_target())
    options = SessionOptions(n_ctx=1024, n_batch=64, n_threads=args.threads, n_rs_seq=16)
    without_heads = SessionOptions.build(options, mtp=False)
    sessions = {
        "plain": Session(target, None, without_heads, lookup=False),
        # the control: plain decoding again on its own Session: what the order of turns and the machine's
        # noise alone make of a ratio that should read 1
        "plain again": Session(target, None, without_heads, lookup=False),
        # any draft source's loop (lookup finds nothing to copy on this random model): what offering,
        # observing and the rollback memory cost per cycle, MTP or not
        "lookup": Session(target, None, without_heads, lookup=True),
        "mtp": Session(target, None, options, lookup=False),
        "mtp+lookup": Session(target, None, options, lookup=True),
    }
    modes = tuple(sessions)
    config = BenchConfig(prompts=[object()], generation=GenerationConfig(max_tokens=args.max_tokens))
    ratios: dict[str, list[float]] = {m: [] for m in modes[1:]}
    identical = dict.fromkeys(modes[1:], 0)
    per_source: dict[str, dict[str, list[int]]] = {m: {} for m in modes[1:]}
    outside: dict[str, list[float]] = {m: [] for m in modes}  # per plain cycle, seconds outside the decode
    runs = 0
    try:
        for repeat in range(args.repeats):
            for messages in PROMPTS:
                gens = {g.mode: g for g in lockstep_generations(sessions, messages, order(modes, repeat), repeat, config)}
                plain = gens["plain"]
                runs += 1
                for m in modes:
                    outside[m] += [st.cycle_s - st.verify_s for st in gens[m].steps if st.kind is StepKind.PLAIN]
                for m in modes[1:]:
                    g = gens[m]
                    ratios[m].append((g.n_tokens / g.decode_s) / (plain.n_tokens / plain.decode_s))
                    identical[m] += g.tokens == plain.tokens
                    for name, s in g.stats.per_source.items():
                        c = per_source[m].setdefault(name, [0, 0, 0])
                        c[0] += s.cycles
                        c[1] += s.n_drafted
                        c[2] += s.n_accepted
    finally:
        for s in sessions.values():
            s.close()
    print(f"target {target.name}, {runs} generations per mode of {args.max_tokens} tokens, {args.threads} thread(s)")
    print("| mode | decode speed vs plain (median) | slowest | identical to plain | per source: cycles, drafted, accepted "
          "| outside the decode per plain cycle (median) |")
    print("|---|---|---|---|---|---|")
    for m in modes:
        us = f"{statistics.median(outside[m]) * 1e6:.0f} µs" if outside[m] else "—"
        if m == "plain":
            print(f"| plain | 1 | | | | {us} |")
            continue
        sources = "; ".join(f"{k} {c[0]}, {c[1]}, {c[2]}" for k, c in per_source[m].items()) or "none drafted"
        print(f"| {m} | {statistics.median(ratios[m]):.3f}x | {min(ratios[m]):.3f}x | {identical[m]}/{runs} | {sources} "
              f"| {us} |")


if __name__ == "__main__":
    main()

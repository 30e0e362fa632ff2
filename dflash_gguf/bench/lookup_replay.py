"""Offline replay of lookup drafting over real greedy outputs, priced with measured verify-cost ratios.

For greedy decoding a lookup draft's acceptance is exactly its agreement with the plain output, so the
n-gram index and the length policy can be compared without timing noise: each cycle costs t(n)/t(1) plain
steps from a measured table (docs/BENCHMARKS.md, section 1), and the speedup is tokens over steps.

    python -m dflash_gguf.bench.lookup_replay --categories copy-heavy --max-tokens 128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings

from dflash_gguf.lookup import NgramIndex, lookup_profile

# t(n)/t(1) on the 2-core build machine, quiet, median of 20 (scripts/measure_threads.py)
COST_RATIOS = {
    "Q4_1 1 thread": {1: 1.0, 2: 2.38, 4: 4.05, 8: 6.69, 16: 11.5},
    "Q4_1 2 threads": {1: 1.0, 2: 1.89, 4: 2.70, 8: 4.23, 16: 7.04},
    "Q8_0 1 thread": {1: 1.0, 2: 3.59, 4: 5.02, 8: 6.20, 16: 7.08},
    "Q8_0 2 threads": {1: 1.0, 2: 2.11, 4: 2.96, 8: 3.64, 16: 4.25},
}


def ratio(table: dict[int, float], n: int) -> float:
    """Linear between measured points, the last segment extended beyond them."""
    ks = sorted(table)
    if n in table:
        return table[n]
    for a, b in zip(ks, ks[1:]):
        if a < n < b:
            return table[a] + (table[b] - table[a]) * (n - a) / (b - a)
    a, b = ks[-2], ks[-1]
    return table[b] + (table[b] - table[a]) / (b - a) * (n - b)


def replay(prompt: list[int], output: list[int], costs: dict[int, float], *, max_draft: int = 32,
           oracle: bool = False) -> float:
    """Speedup over plain decoding of lookup drafting over `output` (greedy), the policy choosing lengths."""
    committed = list(prompt)  # what the target would hold: the index reads it
    index, stats = NgramIndex(committed), lookup_profile()
    index.extend_to(len(committed))
    steps, last, i = 0.0, output[0], 1
    while i < len(output):
        m, n = index.match(last), 0
        room = min(max_draft, len(output) - i)
        if m is not None and room:
            draft = index.continuation(m, last, room)
            agree = 0
            while agree < room and draft[agree] == output[i + agree]:
                agree += 1
            if oracle:
                n = max(range(room + 1), key=lambda k: (min(k, agree) + 1) / ratio(costs, k + 1))
            else:
                e = stats.expected_tokens(m.length, room)
                n = max(range(room + 1), key=lambda k: e[k] / ratio(costs, k + 1))
        accepted = 0
        if n:
            accepted = min(n, agree)
            stats.observe(m.length, n, accepted)
        committed += [last, *output[i : i + accepted]]
        index.extend_to(len(committed))
        steps += ratio(costs, n + 1)
        last = output[i + accepted] if i + accepted < len(output) else 0
        i += accepted + 1
    return (len(output) - 1) / steps


def greedy_outputs(prompts, max_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """(id, prompt tokens, greedy plain output) on the embedded target, chat template, one thread."""
    from dflash_gguf.chat import ChatRequest
    from dflash_gguf.session import Session

    out = []
    with warnings.catch_warnings(), Session(n_ctx=2048, n_threads=1) as s:
        warnings.simplefilter("ignore")
        for p in prompts:
            tokens = s.prepare_chat(ChatRequest([{"role": "user", "content": p.prompt}])).tokens
            s.reset()
            r = s.chat([{"role": "user", "content": p.prompt}], max_tokens=max_tokens, speculative=False)
            out.append((p.id, tokens, r.tokens))
    return out


def main(argv=None) -> int:
    from .suite import load_suite

    ap = argparse.ArgumentParser(prog="python -m dflash_gguf.bench.lookup_replay", description=__doc__.split("\n")[0])
    ap.add_argument("--categories", nargs="+", default=["copy-heavy"])
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    runs = greedy_outputs(load_suite(categories=args.categories), args.max_tokens)
    print("| cost curve | policy median | policy slowest | oracle median | per prompt (policy) |")
    print("|---|---|---|---|---|")
    for name, costs in COST_RATIOS.items():
        policy = [replay(p, o, costs) for _, p, o in runs]
        oracle = [replay(p, o, costs, oracle=True) for _, p, o in runs]
        print(f"| {name} | {statistics.median(policy):.2f}x | {min(policy):.2f}x | {statistics.median(oracle):.2f}x | "
              + " ".join(f"{x:.2f}" for x in policy) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

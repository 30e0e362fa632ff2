"""How often and how far a warm (prompt-cached) greedy reply parts from the cold one, on the embedded pair.

    python scripts/measure_cold_warm.py [--prompts 24] [--block-size 4 | --adaptive] [--max-tokens 16]

Two cases per prompt (tests/test_cold_warm.py's prompts: 100-400 tokens of prose, code, lists, dialogue):
- resend: the prompt again, restored from the RAM tier (its first n - 1 positions) against its cold run;
- follow-up: prompt + reply + a new user turn, the cached prompt + reply restored (their rows came from the
  prefill and the verify blocks), against a cold prefill of the whole follow-up.
Prints, for each case, how many replies parted and at which reply token they first differ.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_cold_warm import prompt_tokens  # noqa: E402  (the prompts the test checks)

from dflash_gguf import Session  # noqa: E402
from dflash_gguf.prompt_cache import PromptCache  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The index of the first token where a and b differ (None: equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--adaptive", action="store_true", help="the adaptive controller instead of --block-size")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--n-threads", type=int, default=1)
    args = p.parse_args()
    block = None if args.adaptive else args.block_size
    gen = dict(max_tokens=args.max_tokens, block_size=block)
    cache = PromptCache(ram_bytes=1 << 30)
    parted: dict[str, list[tuple[int, int, int]]] = {"resend": [], "follow-up": []}  # (prompt, tokens, index)
    with Session(prompt_cache=cache, n_ctx=2048, n_threads=args.n_threads) as cold, cold.fork() as warm:

        def run(session: Session, tokens: list[int]) -> tuple[list[int], int]:
            session.reset()
            out = [t for step in session.stream_tokens(tokens, **gen) for t in step.tokens]
            return out, session.last_stats.prompt_cache.n_restored

        for i in range(args.prompts):
            prompt = prompt_tokens(cold, i)
            cache.clear()
            reply, _ = run(cold, prompt)  # stores prompt + reply
            again, restored = run(warm, prompt)
            assert restored == len(prompt) - 1
            follow = prompt + reply + cold.tokenize("\n\nUser: and what comes next, in one line?\nAssistant:",
                                                    add_special=False)
            warm_follow, restored = run(warm, follow)
            assert restored >= len(prompt)
            cache.clear()
            cold_follow, _ = run(cold, follow)
            for case, a, b, n in (("resend", reply, again, len(prompt)), ("follow-up", cold_follow, warm_follow, len(follow))):
                at = first_difference(a, b)
                if at is not None:
                    parted[case].append((i, n, at))
            print(f"prompt {i:2d}: {len(prompt)} tokens, follow-up {len(follow)}: resend "
                  f"{'same' if first_difference(reply, again) is None else 'PARTED'}, follow-up "
                  f"{'same' if first_difference(cold_follow, warm_follow) is None else 'PARTED'}", flush=True)
    mode = "adaptive blocks" if block is None else f"block size {block}"
    print(f"\n{args.prompts} prompts, {mode}, {args.max_tokens} greedy tokens, flash attention on, "
          f"{args.n_threads} thread(s)")
    for case, rows in parted.items():
        where = ", ".join(f"prompt {i} ({n} tokens) at token {at}" for i, n, at in rows) or "-"
        print(f"{case}: {len(rows)} of {args.prompts} parted: {where}")


if __name__ == "__main__":
    main()

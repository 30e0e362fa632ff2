"""KV cache types: bytes per cached token (target and drafter, as llama_state_seq saves them) and whether greedy
speculative decoding still equals plain decoding at that type.

    python scripts/measure_kv_types.py [--target T --drafter D] [--types f16 q8_0 q4_0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_gguf import Session

PROMPT = ("<|im_start|>system\nYou are a coding agent. Read the file and answer.<|im_end|>\n<|im_start|>user\n"
          + "def add(a, b):\n    return a + b\n\n" * 60 + "What does add do? Explain in detail.<|im_end|>\n"
          "<|im_start|>assistant\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path)
    p.add_argument("--drafter", type=Path)
    p.add_argument("--types", nargs="+", default=["f16", "q8_0", "q4_0"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=4, help="fixed, so every cycle drafts (default 4)")
    args = p.parse_args()
    rows = []
    for kv in args.types:
        with Session(args.target, args.drafter, n_ctx=2048, n_threads=args.threads, type_k=kv, type_v=kv) as s:
            spec = s.generate(PROMPT, max_tokens=args.max_tokens, block_size=args.block_size)
            n = s.target.pos_max(0) + 1
            target_bytes = len(s.target.save_sequence())
            drafter_bytes = len(s.drafter.save_state()) if s.drafter is not None else 0
            s.reset()
            plain = s.generate(PROMPT, max_tokens=args.max_tokens, speculative=False)
        rows.append((kv, n, target_bytes / n, drafter_bytes / n, spec.tokens == plain.tokens, spec.stats.n_accepted,
                     spec.stats.n_drafted))
    base = rows[0][2] + rows[0][3]
    print("| KV type | tokens | target B/token | drafter B/token | total vs first | greedy spec == plain | accepted/drafted |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    for kv, n, t, d, same, acc, drafted in rows:
        print(f"| {kv} | {n} | {t:,.0f} | {d:,.0f} | {(t + d) / base:.2f} | {'yes' if same else 'NO'} | {acc}/{drafted} |")


if __name__ == "__main__":
    main()

"""KV cache types: bytes per cached token (target and drafter, as llama_state_seq saves them), what a prompt-cache
entry costs per cached token in RAM (the RSS it holds) and on disk (its file), and whether greedy speculative
decoding still equals plain decoding at that type.

For each type one Session with a prompt cache (RAM tier and a directory) answers the prompt speculatively,
which stores the entry of prompt + reply. RAM: the process's RSS before and after the cache drops that entry
(cache.clear()), each read after glibc's malloc_trim so that freed memory is returned to the system and not
merely kept by the allocator; Disk: the entry's file size. Then, the cache empty, the same Session answers the prompt again after reset(), plainly.

    python scripts/measure_kv_types.py [--target T --drafter D] [--types f16 q8_0 q4_0]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import tempfile
from pathlib import Path

from dflash_gguf import Session
from dflash_gguf.prompt_cache import SUFFIX, PromptCache

PROMPT = ("<|im_start|>system\nYou are a coding agent. Read the file and answer.<|im_end|>\n<|im_start|>user\n"
          + "def add(a, b):\n    return a + b\n\n" * 60 + "What does add do? Explain in detail.<|im_end|>\n"
          "<|im_start|>assistant\n")


def rss_bytes() -> int:
    """The resident set size of this process once freed memory is handed back (Linux, glibc)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


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
    with tempfile.TemporaryDirectory(prefix="dflash-kv-") as tmp:
        for kv in args.types:
            cache = PromptCache(ram_bytes=1 << 30, directory=Path(tmp) / kv)
            with Session(args.target, args.drafter, n_ctx=2048, n_threads=args.threads, type_k=kv, type_v=kv,
                         prompt_cache=cache) as s:
                spec = s.generate(PROMPT, max_tokens=args.max_tokens, block_size=args.block_size)
                n = s.target.pos_max(0) + 1
                target_bytes = len(s.target.save_sequence())
                drafter_bytes = len(s.drafter.save_state()) if s.drafter is not None else 0
                if not spec.stats.prompt_cache.stored or cache.entries != {"ram": 1, "disk": 1}:
                    raise SystemExit(f"{kv}: the generation did not store one entry ({spec.stats.prompt_cache})")
                cache.flush()  # the disk entry is written by the cache's writer thread
                (entry,) = cache.directory.glob(f"*{SUFFIX}")
                disk = entry.stat().st_size
                held = rss_bytes()
                cache.clear()
                ram = held - rss_bytes()
                s.reset()
                plain = s.generate(PROMPT, max_tokens=args.max_tokens, speculative=False)
                if plain.stats.prompt_cache.tier is not None:
                    raise SystemExit(f"{kv}: the plain run was served by the cleared cache")
            rows.append((kv, n, target_bytes / n, drafter_bytes / n, ram / n, disk / n,
                         spec.tokens == plain.tokens, spec.stats.n_accepted, spec.stats.n_drafted))
    base = rows[0][2] + rows[0][3]
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| KV type | tokens | target B/token | drafter B/token | total vs first | prompt cache RAM (RSS) B/token "
          "| prompt cache disk B/token | greedy spec == plain | accepted/drafted |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for kv, n, t, d, ram, disk, same, acc, drafted in rows:
        print(f"| {kv} | {n} | {t:,.0f} | {d:,.0f} | {(t + d) / base:.2f} | {ram:,.0f} | {disk:,.0f} | "
              f"{'yes' if same else 'NO'} | {acc}/{drafted} |")


if __name__ == "__main__":
    main()

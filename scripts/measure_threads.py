"""What a target batch of n tokens costs with 1 and with 2 threads, side by side in one process.

    python scripts/measure_threads.py [--target T.gguf] [--requant-dir DIR] [--threads 1 2] [--repeats 20]

The target (default: the embedded Q4_1 file) and its Q8_0 requantization are measured in one interleaved
sweep, switching the thread count of the same context (llama_set_n_threads) between repeats, so machine load
hits every setting alike. Every figure is the median wall time over the repeats, and every ratio is against
the 1-token step of the same file and thread count: the cost of verifying n tokens, in plain steps of that
setting. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path


from dflash_gguf.bench.kernels import context_tokens, prepare_variants, time_batch
from dflash_gguf.defaults import embedded_target
from dflash_gguf.target import Target

SIZES = (1, 2, 3, 4, 8, 16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=None, help="target GGUF (default: the embedded Q4_1 file)")
    p.add_argument("--requant-dir", type=Path, default=None, help="where the Q8_0 requantization is kept")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args()
    threads = sorted(set(a.threads))
    with tempfile.TemporaryDirectory() as tmp:
        variants = prepare_variants(a.target or embedded_target(), a.requant_dir or Path(tmp), ("Q8_0",))
        targets = {name: Target.open(path, n_ctx=1024, n_batch=512, n_threads=threads[0]) for name, path in variants.items()}
        try:
            context = context_tokens(next(iter(targets.values())))
            for target in targets.values():
                target.decode(context, 0, logits=False)
            seconds: dict[tuple[str, int, int], list[float]] = {}
            for rep in range(a.repeats + 1):  # rep 0 is the warm-up
                order = threads if rep % 2 else threads[::-1]
                for name, target in targets.items():
                    for n_threads in order:
                        target.set_threads(n_threads)
                        for n in SIZES:
                            wall, _ = time_batch(target, context, n)
                            if rep:
                                seconds.setdefault((name, n_threads, n), []).append(wall)
        finally:
            for target in targets.values():
                target.close()
    print("| file | threads | " + " | ".join(f"t({n}) ms" for n in SIZES) + " | " + " | ".join(f"t({n})/step" for n in SIZES[1:]) + " |")
    print("|---" * (2 + 2 * len(SIZES) - 1) + "|")
    for name in targets:
        for n_threads in threads:
            ms = [statistics.median(seconds[(name, n_threads, n)]) for n in SIZES]
            step = ms[0]
            print(
                f"| {name} | {n_threads} | " + " | ".join(f"{m * 1e3:.2f}" for m in ms) + " | "
                + " | ".join(f"{m / step:.2f}x" for m in ms[1:]) + " |"
            )


if __name__ == "__main__":
    main()

"""What a generation waits for when it stores its state in the prompt cache, against when the entry is on disk.

PromptCache.store() keeps the RAM tier's entry and queues the disk write (checksum, temp file, rename) for the
cache's writer thread, so the reply ends without waiting for it. This prints, for an entry of the given size
(default: the embedded pair's f16 state after 9,680 tokens, 232 MB), the time store() took and the time until
the file was in place (flush()), in a directory of your choice (default: a temp directory on /tmp's disk).

    python scripts/measure_cache_store.py                        # 232 MB, 3 reps
    python scripts/measure_cache_store.py --mb 1400 --dir /path/on/the/cache/disk
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from dflash_gguf.prompt_cache import PromptCache, Snapshot, context_id


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=232.0, help="entry size in MB (default 232)")
    p.add_argument("--tokens", type=int, default=9680)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", help="where the temp cache directories go (default: the system's temp directory)")
    args = p.parse_args()
    if args.mb <= 0 or args.tokens < 1 or args.reps < 1:
        p.error("--mb, --tokens and --reps must be positive")
    rng = np.random.default_rng(0)
    state = rng.bytes(max(1, int(args.mb * 1e6) - 4 * args.tokens))
    context = context_id({"measure": "store"})
    for rep in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="dflash-store-", dir=args.dir) as d:
            cache = PromptCache(ram_bytes=len(state) + (1 << 20) + 4 * args.tokens, directory=d)
            snapshot = Snapshot(tuple(int(t) for t in rng.integers(0, 49152, args.tokens)), {"target": state})
            t0 = time.perf_counter()
            cache.store(context, snapshot)
            returned = time.perf_counter() - t0
            cache.flush()
            on_disk = time.perf_counter() - t0
        print(f"rep {rep}: {args.mb:.0f} MB entry: store() returned after {returned * 1000:.0f} ms, on disk after "
              f"{on_disk * 1000:.0f} ms (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()

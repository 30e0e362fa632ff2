"""What one decode of k sequences' single rows costs in the shared context, outside any server (issue 37).

Opens the target as `dflash-serve --parallel P --batch-slots` opens its shared context (P sequences, a KV stream
of --n-ctx cells each, flash attention as the default, the drafter's layer inputs captured unless
--no-capture), prefills every sequence with the same prompt, then times decodes of one row for each of k
sequences (k = 1, 2, 4, ... P, the sequences 0..k-1: one pass), each row taken back out of the cache after it is
timed so every decode sees the same cache. Its figure, set beside the server's time per batch at the same
concurrency (scripts/bench_batching.py), says how much of a batched server's cycle is libllama's and how much
the server's own; --json writes the medians as a cost curve for scripts/project_batching.py.

--caller thread times the same decodes made from a second thread while the main thread, which prefilled the
sequences, keeps its OpenMP team: ggml-cpu runs a graph as an OpenMP region, libgomp keeps a team of workers
per thread that ever started one, and once the teams outnumber the CPUs its barriers sleep instead of spinning
(why a shared context decodes on one thread of its own: docs/DESIGN.md, "One thread decodes").

    python scripts/measure_batched_decode.py --parallel 8 --threads 2 [--json curve.json] [--caller thread]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dflash_gguf import defaults  # noqa: E402
from dflash_gguf.target import Target  # noqa: E402

PROMPT = list(range(100, 140))  # 40 prompt tokens per sequence; any ids the vocabulary has
CAPTURED_LAYERS = (1, 8, 15, 22, 28)  # five layer inputs, as a five-layer drafter asks of the 30-layer target


def timed_decodes(target: Target, k: int, position: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` decodes of one row for each of sequences 0..k-1 at `position`."""
    rows = np.arange(k)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        target.decode(200 + rows, np.full(k, position), rows, logits=True)
        times.append(time.perf_counter() - t0)
        for seq in range(k):
            target.remove(seq, position, -1)
    return times


def on_caller(caller: str, f: Callable[..., list[float]], *args: object) -> list[float]:
    """f(*args) in this thread, or in a second one that ends after it (its OpenMP team goes with it)."""
    if caller == "main":
        return f(*args)
    out = []
    worker = threading.Thread(target=lambda: out.append(f(*args)))
    worker.start()
    worker.join()
    return out[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, default=None, help="target GGUF (default: the embedded one)")
    p.add_argument("--parallel", type=int, default=8, help="sequences of the shared context (default 8)")
    p.add_argument("--n-ctx", type=int, default=8192, help="cells per sequence (default 8192, the model's)")
    p.add_argument("--n-batch", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-capture", action="store_true", help="leave the drafter's layer inputs uncaptured")
    p.add_argument("--json", type=Path, help="write {label, seconds: {k: median}} here (a cost curve)")
    p.add_argument("--caller", choices=("main", "thread"), default="main",
                   help="which thread times the decodes: the main one, which prefilled, or a second one")
    a = p.parse_args()
    if a.parallel < 1 or a.n_ctx < len(PROMPT) + 1 or a.threads < 1 or a.repeats < 1:
        p.error("--parallel, --threads and --repeats must be >= 1 and --n-ctx must hold the prompt")
    path = a.target or defaults.embedded_target()
    try:
        target = Target.open(path, n_ctx=a.parallel * a.n_ctx, n_batch=a.n_batch, n_seq_max=a.parallel,
                             n_threads=a.threads)
    except (OSError, ValueError) as e:  # no such file, not a GGUF libllama loads, a context it cannot make
        p.error(str(e))
    try:
        if not a.no_capture:
            target.capture(CAPTURED_LAYERS)
        for seq in range(a.parallel):
            target.decode(PROMPT, 0, seq)
        single = None
        curve = {}
        for k in sorted({*(2 ** i for i in range(a.parallel.bit_length()) if 2 ** i <= a.parallel), a.parallel}):
            ms = 1000 * statistics.median(on_caller(a.caller, timed_decodes, target, k, len(PROMPT), a.repeats))
            single = single or ms
            curve[k] = ms / 1000
            print(f"{k} sequence(s) x 1 row: median {ms:.1f} ms ({ms / single:.2f} single steps), "
                  f"{a.threads} thread(s), capture {'off' if a.no_capture else 'on'}, decoded from {'the main thread' if a.caller == 'main' else 'a second thread'}")
        if a.json:
            label = (f"{path.name}, this machine's CPU, {a.threads} thread(s): k sequences x 1 row in one pass "
                     f"(scripts/measure_batched_decode.py)")
            a.json.write_text(json.dumps({"label": label, "seconds": curve}, indent=1))
    finally:
        target.close()


if __name__ == "__main__":
    main()

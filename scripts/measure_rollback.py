"""What a rollback costs on hybrid targets, per mechanism, as a ratio to one decode step (issue 10).

    python scripts/measure_rollback.py [--dir /tmp/hybrid-fixtures] [--threads 1] [--reps 40]

Builds the tiny random fixtures of tests/hybrid_fixtures.py into --dir when they are missing. For each
target and mechanism: a verify batch of B tokens at a context of 64, kept to 1 (the common case with a
weak drafter), timed from keep() in (the rollback), plus what before_verify costs (the checkpoint save).
Also the memory n_rs_seq adds, and the batch variance of the recurrent kernels (verify vs single decode).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from dflash_gguf.defaults import embedded_target  # noqa: E402
from dflash_gguf.memory import memory_for  # noqa: E402
from dflash_gguf.target import Target  # noqa: E402


def fixtures(directory: Path) -> dict[str, Path]:
    import hybrid_fixtures

    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for arch in hybrid_fixtures.ARCHS:
        path = directory / f"{arch}.gguf"
        out[arch] = path if path.is_file() else hybrid_fixtures.build_target(arch, directory, embedded_target())
    return out


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def measure(path: Path, n_rs_seq: int, block: int, reps: int, threads: int) -> dict:
    tokens = list(range(1000, 1000 + 64 + reps * block + 64))
    with Target.open(path, n_ctx=2048, n_batch=64, n_threads=threads, n_rs_seq=n_rs_seq) as t:
        t.capture([1, 3])
        memory = memory_for(t)
        memory.truncate(0)
        t.decode(tokens[:64], 0)
        n_past = 64
        step, save, rollback = [], [], []
        for _ in range(reps):
            s = time.perf_counter()
            t.decode([tokens[n_past]], n_past, logits=True)
            step.append(time.perf_counter() - s)
            n_past += 1
            block_tokens = tokens[n_past : n_past + block]
            s = time.perf_counter()
            memory.before_verify(n_past, block)
            save.append(time.perf_counter() - s)
            t.decode(block_tokens, n_past, logits=True)
            s = time.perf_counter()
            memory.keep(n_past, block_tokens, 1)
            rollback.append(time.perf_counter() - s)
            n_past += 1
        return {
            "memory": memory.name,
            "n_rs_seq": t.n_rs_seq,
            "step_ms": median_ms(step),
            "save_ms": median_ms(save),
            "rollback_ms": median_ms(rollback),
            "state_bytes": getattr(memory, "state_bytes", 0),
            "extra_bytes": memory.extra_bytes,
        }


def batch_variance(path: Path) -> float:
    """Largest |logit| difference between one 20-token batch and 20 single-token decodes."""
    tokens = list(range(500, 520))
    with Target.open(path, n_ctx=256, n_batch=64, n_threads=1) as t:
        t.decode(tokens, 0, logits=True)
        batch = t.output_logits().copy()
        t.clear()
        single = []
        for i, tok in enumerate(tokens):
            t.decode([tok], i, logits=True)
            single.append(t.output_logits()[0].copy())
    return float(np.abs(batch - np.array(single)).max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path("/tmp/hybrid-fixtures"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--block", type=int, default=16)
    args = p.parse_args()
    paths = fixtures(args.dir)
    print(f"block {args.block} kept to 1, context 64+, {args.threads} thread(s), median of {args.reps}")
    print(f"{'target':<10} {'memory':<12} {'n_rs_seq':>8} {'step ms':>8} {'save ms':>8} {'rollback ms':>11}"
          f" {'(save+rollback)/step':>21} {'state B':>8} {'extra B':>8}")
    rows = [("smollm2", embedded_target(), 0)]
    for arch, path in paths.items():
        rows += [(arch, path, args.block - 1), (arch, path, 0)]
    for name, path, n_rs in rows:
        r = measure(path, n_rs, args.block, args.reps, args.threads)
        ratio = (r["save_ms"] + r["rollback_ms"]) / r["step_ms"]
        print(f"{name:<10} {r['memory']:<12} {r['n_rs_seq']:>8} {r['step_ms']:>8.3f} {r['save_ms']:>8.3f}"
              f" {r['rollback_ms']:>11.3f} {ratio:>21.2f} {r['state_bytes']:>8} {r['extra_bytes']:>8}")
    for arch, path in paths.items():
        print(f"batch variance {arch}: max |logit(batch) - logit(single)| = {batch_variance(path):.4f}")


if __name__ == "__main__":
    main()

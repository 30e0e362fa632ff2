"""KV bytes per slot (issue 37): a context per slot against one context whose sequences are the slots.

Opens the target the way `dflash-serve --parallel P --n-ctx N` does, both ways: P contexts of N cells (one per
slot, the per-slot server) and one context of P x N cells with a KV stream per sequence (`--batch-slots`),
and reads the buffers libllama says it allocated (KV, compute, output). Then it decodes --tokens tokens into
one sequence of each and saves its state (Target.save_sequence): the bytes a slot's state takes (what the
prompt cache stores), which the layout must not change.

    python scripts/measure_slot_memory.py --parallel 8 --n-ctx 1024
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from pathlib import Path

from llama_cpp._logger import set_verbose

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from dflash_gguf import defaults  # noqa: E402
from dflash_gguf.config import SessionOptions  # noqa: E402
from dflash_gguf.target import Target  # noqa: E402

BUFFERS = {"kv": r"KV buffer size = +([\d.]+) MiB", "compute": r"compute buffer size = +([\d.]+) MiB",
           "output": r"output buffer size = +([\d.]+) MiB"}


def opened(path: Path, **settings: object) -> tuple[Target, dict[str, float]]:
    """The target opened with libllama's log captured; the MiB of each kind of buffer it allocated."""
    log = io.StringIO()
    with contextlib.redirect_stderr(log):  # llama-cpp-python prints libllama's log to sys.stderr
        target = Target.open(path, verbose=True, **settings)
    set_verbose(False)
    text = log.getvalue()
    return target, {k: sum(float(m) for m in re.findall(rx, text)) for k, rx in BUFFERS.items()}


def state_bytes(target: Target, seq: int, n_tokens: int) -> int:
    """The bytes of sequence `seq`'s saved state after n_tokens tokens decoded into it."""
    tokens = [(i * 7919) % 1000 + 100 for i in range(n_tokens)]
    for start in range(0, n_tokens, target.n_batch):
        chunk = tokens[start : start + target.n_batch]
        target.decode(chunk, start, seq_ids=seq, logits=False)
    return len(target.save_sequence(seq))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, help="the target GGUF (default: the embedded one)")
    p.add_argument("--parallel", type=int, default=8, help="slots")
    p.add_argument("--n-ctx", type=int, default=1024, help="cells per slot (dflash-serve --n-ctx)")
    p.add_argument("--tokens", type=int, default=512, help="tokens in the sequence whose state is measured")
    a = p.parse_args()
    if a.parallel < 2:
        p.error("--parallel must be at least 2: one slot has nothing to share")
    if not 0 < a.tokens <= a.n_ctx:
        p.error(f"--tokens must be in [1, --n-ctx {a.n_ctx}]")
    path = a.target or defaults.embedded_target()
    if not Path(path).is_file():
        p.error(f"--target {path}: no such file")
    n_batch = SessionOptions().n_batch
    rows = []
    own, sizes = opened(path, n_ctx=a.n_ctx, n_batch=n_batch)
    with own:
        state = state_bytes(own, 0, a.tokens)
    rows.append(("a context per slot (per-slot server)", a.parallel, sizes, state))
    shared, sizes = opened(path, n_ctx=a.n_ctx * a.parallel, n_batch=n_batch, n_seq_max=a.parallel, kv_unified=False)
    with shared:
        state = state_bytes(shared, a.parallel - 1, a.tokens)
    rows.append(("one context, a KV stream per slot (--batch-slots)", 1, sizes, state))
    print(f"\n{path.name if isinstance(path, Path) else path}, {a.parallel} slots of {a.n_ctx} cells, n_batch {n_batch}")
    print("\n| layout | contexts | KV MiB per slot | compute MiB per slot | output MiB per slot | all slots, MiB | "
          f"state of a slot after {a.tokens} tokens, bytes |")
    print("|---|---|---|---|---|---|---|")
    for name, contexts, s, state in rows:
        per = {k: v * contexts / a.parallel for k, v in s.items()}
        total = sum(s.values()) * contexts
        print(f"| {name} | {contexts} | {per['kv']:.2f} | {per['compute']:.2f} | {per['output']:.2f} | {total:.1f} | "
              f"{state} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

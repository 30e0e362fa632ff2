"""How far a batched decode's logits are from the same tokens decoded one at a time, every layer on the GPU
device, with ggml-vulkan's f16 paths on and off (issue 24).

    GGML_VK_VISIBLE_DEVICES=0 .cache/vulkan/venv/bin/python scripts/measure_vulkan_batch.py [--json]

A speculative verify decodes a block of tokens in one batch; plain decoding decodes them one at a time.
On a batch-invariant backend (the CPU with flash attention) both give the same logits bit for bit, so
greedy speculative output equals plain decoding exactly. Where they differ by d, a token whose top two
logits are closer than d can flip. For each target, each batch size R in --rows and each prefix length P
in --prefixes: P tokens prefilled, then the next R tokens as one batch (every row's logits) against the
same R tokens decoded one each; the figure is the largest |logit difference| over the rows and prefixes,
and how many rows' top token differs.

ggml-vulkan reads GGML_VK_DISABLE_F16 when it opens the device, so each setting (--f16 on off) is measured
in a child process of its own. The qwen35 fixture (tests/hybrid_fixtures.py, random weights; built with
upstream's converter, so DFLASH_LLAMA_CPP_SRC or .cache/upstream is needed) is built into --fixtures once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TEXT = ("The history of the city begins in the Roman period, when a small settlement grew up at a crossing "
        "of the river. Over the following centuries it became a market town, then a centre of the wool trade, "
        "and by the eighteenth century one of the largest ports in the country.")


def measure(path: Path, rows: list[int], prefixes: list[int]) -> dict:
    """{"device", "rows": {R: {"max_abs": ..., "argmax_differs": ...}}} for one model, in this process."""
    import numpy as np

    from dflash_gguf.backends import placement
    from dflash_gguf.target import Target

    n = max(rows)
    with Target.open(path, n_ctx=512, n_batch=64, n_gpu_layers=-1, n_threads=1) as t:
        where = placement(t.model, -1)
        if not where.gpus or where.on_cpu:
            raise SystemExit(f"{path}: not every layer on a GPU device ({where.device})")
        tokens = t.vocab.tokenize(TEXT)
        if len(tokens) < max(prefixes) + n:
            raise SystemExit(f"the text has {len(tokens)} tokens, fewer than prefix {max(prefixes)} + {n} rows")
        out = {r: {"max_abs": 0.0, "argmax_differs": 0} for r in rows}
        for p in prefixes:
            t.clear()
            t.decode(tokens[:p], 0)
            single = []
            for i in range(n):
                t.decode([tokens[p + i]], p + i, logits=True)
                single.append(t.output_logits()[0].copy())
            single = np.array(single)
            for r in rows:
                t.clear()
                t.decode(tokens[:p], 0)
                t.decode(tokens[p : p + r], p, logits=True)
                batch = t.output_logits().copy()
                diff = float(np.abs(batch - single[:r]).max())
                out[r]["max_abs"] = max(out[r]["max_abs"], diff)
                out[r]["argmax_differs"] += int((batch.argmax(1) != single[:r].argmax(1)).sum())
        return {"device": where.device, "rows": out}


def qwen35_fixture(directory: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from hybrid_fixtures import build_target

    from dflash_gguf.defaults import embedded_target

    path = directory / "qwen35.gguf"
    return path if path.is_file() else build_target("qwen35", directory, embedded_target())


def run_child(f16: str, models: dict[str, Path], args: argparse.Namespace) -> dict:
    """This script in a child process with GGML_VK_DISABLE_F16 set (f16 "off") or unset (f16 "on")."""
    env = {k: v for k, v in os.environ.items() if k != "GGML_VK_DISABLE_F16"}
    if f16 == "off":
        env["GGML_VK_DISABLE_F16"] = "1"
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")  # lavapipe is a CPU-type device, skipped unless named
    argv = [sys.executable, __file__, "--child", json.dumps({k: str(v) for k, v in models.items()}),
            "--rows", *map(str, args.rows), "--prefixes", *map(str, args.prefixes)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"f16 {f16}: the child failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", type=Path, help="GGUFs (default: the embedded target, the qwen35 fixture)")
    p.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 9, 16])
    p.add_argument("--prefixes", nargs="+", type=int, default=[5, 24])
    p.add_argument("--f16", nargs="+", default=["on", "off"], choices=["on", "off"])
    p.add_argument("--fixtures", type=Path, default=ROOT / ".cache/vulkan/hybrid-fixtures")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child (a cold shader cache compiles)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        models = json.loads(args.child)
        print(json.dumps({name: measure(Path(path), args.rows, args.prefixes) for name, path in models.items()}))
        return

    from dflash_gguf.defaults import embedded_target

    targets = args.targets or [embedded_target(), qwen35_fixture(args.fixtures)]
    models = {path.stem: path for path in targets}
    results, seconds = {}, {}
    for f16 in args.f16:
        start = time.monotonic()
        results[f16] = run_child(f16, models, args)
        seconds[f16] = round(time.monotonic() - start)
    if args.json:
        print(json.dumps({"results": results, "seconds": seconds}))
        return
    print(f"max |logit(batch of R) - logit(R single decodes)| (rows whose top token differs), prefixes {args.prefixes}")
    print(f"{'model':<28} {'f16':<4} " + " ".join(f"{'R=' + str(r):>14}" for r in args.rows) + "  device")
    for f16, per_model in results.items():
        for name, r in per_model.items():
            cells = " ".join(f"{v['max_abs']:>9.2e} ({v['argmax_differs']:>2})" for v in r["rows"].values())
            print(f"{name:<28} {f16:<4} {cells}  {r['device']}")
    print("seconds per setting: " + ", ".join(f"f16 {k}: {v}" for k, v in seconds.items()))


if __name__ == "__main__":
    main()

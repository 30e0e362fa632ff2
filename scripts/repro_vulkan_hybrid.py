"""Count crashes of speculative decoding on a hybrid target with every layer on a GPU device (issue 24).

On Debian 12's Mesa 22.3.6 lavapipe the qwen35 fixture with its DFlash drafter, every layer offloaded,
crashed inside the driver in about one run in five (docs/BACKENDS.md). A crash kills the process, so each
run is a child process: the parent counts exits by signal and compares each child's greedy tokens with
plain decoding's, decoded once in a child of its own on the same device.

    GGML_VK_VISIBLE_DEVICES=0 .cache/vulkan/venv/bin/python scripts/repro_vulkan_hybrid.py --runs 20

The fixtures (tests/hybrid_fixtures.py: random weights, built with upstream's converter, so
DFLASH_LLAMA_CPP_SRC or .cache/upstream is needed) are built once into --fixtures and reused.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Good morning!"

CHILD = """
import json, sys
from dflash_gguf import Session
target, drafter, speculative, block, n, flash = sys.argv[1:7]
with Session(target, drafter, n_ctx=512, n_batch=64, n_threads=1, n_gpu_layers=-1, flash_attn=flash == "on") as s:
    r = s.generate(sys.argv[7], max_tokens=int(n), speculative=speculative == "yes", block_size=int(block))
    print(json.dumps({"tokens": r.tokens, "device": r.stats.device, "drafter_device": r.stats.drafter_device}))
"""


def fixtures(directory: Path, arch: str) -> tuple[Path, Path]:
    """The hybrid target and its DFlash drafter, built into directory unless already there."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hybrid_fixtures import build_drafter, build_target

    from dflash_gguf.defaults import embedded_target

    target = directory / f"{arch}.gguf"
    drafters = sorted((directory / f"{arch}-dflash").glob("*.gguf")) if (directory / f"{arch}-dflash").is_dir() else []
    if not target.exists():
        target = build_target(arch, directory, embedded_target())
    drafter = drafters[0] if drafters else build_drafter(target, directory / f"{arch}-dflash")
    return target, drafter


def run_child(args: argparse.Namespace, target: Path, drafter: Path, speculative: bool) -> tuple[int, dict | None, str]:
    """(exit status, the child's JSON line or None, the end of its stderr)."""
    argv = [sys.executable, "-c", CHILD, str(target), str(drafter), "yes" if speculative else "no",
            str(args.block_size), str(args.max_tokens), args.flash_attn, PROMPT]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, json.loads(lines[-1]) if lines else None, done.stderr[-600:]


def describe(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit {code}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="speculative runs, each in a child process")
    p.add_argument("--arch", default="qwen35", choices=["qwen35", "lfm2"])
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--flash-attn", choices=["on", "off"], default="off")
    p.add_argument("--fixtures", type=Path, default=ROOT / ".cache/vulkan/hybrid-fixtures")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child before it counts as hung")
    args = p.parse_args()

    target, drafter = fixtures(args.fixtures, args.arch)
    start = time.monotonic()
    code, plain, err = run_child(args, target, drafter, speculative=False)
    if code != 0 or plain is None:
        print(f"plain decoding failed ({describe(code)}):\n{err}", file=sys.stderr)
        return 1
    print(f"plain: {len(plain['tokens'])} tokens on {plain['device']} ({time.monotonic() - start:.0f} s)", flush=True)

    crashes, differ = [], 0
    for i in range(args.runs):
        t = time.monotonic()
        code, out, err = run_child(args, target, drafter, speculative=True)
        if code != 0:
            crashes.append(describe(code))
            last = err.strip().splitlines()[-1] if err.strip() else ""
            print(f"run {i + 1}: CRASH {describe(code)} ({time.monotonic() - t:.0f} s) {last}", flush=True)
            continue
        same = out is not None and out["tokens"] == plain["tokens"]
        differ += not same
        print(f"run {i + 1}: ok, {'identical to plain' if same else 'DIFFERS from plain'}, "
              f"drafter on {out and out['drafter_device']} ({time.monotonic() - t:.0f} s)", flush=True)
    print(f"{args.arch} block {args.block_size} flash_attn {args.flash_attn}: {len(crashes)} crashes in {args.runs} runs "
          f"({', '.join(crashes) or 'none'}), {differ} of {args.runs - len(crashes)} completed runs differ from plain; "
          f"{time.monotonic() - start:.0f} s")
    return 1 if crashes or differ else 0


if __name__ == "__main__":
    sys.exit(main())

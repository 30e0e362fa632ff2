"""Start-up time with and without a saved calibration: the same Session opened in two fresh processes.

    python scripts/measure_startup.py [--threads N] [--target T.gguf --drafter D.gguf] [--runs K]

Each start is its own process (as a user's second `dflash-generate` is), sharing one empty calibration
folder: the first measures the verify and draft costs and saves them, the next ones reuse them. Printed per
start: opening the Session, the first adaptive reply of a few tokens (calibration included) in wall time and
in process CPU time (the steadier of the two on a shared machine), and where the costs came from.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPT = "The capital of France is"


def child(args: argparse.Namespace) -> None:
    from dflash_gguf import Session

    start = time.perf_counter()
    with Session(args.target, args.drafter, n_threads=args.threads, n_ctx=1024, lookup=False) as s:
        opened, opened_cpu = time.perf_counter(), time.process_time()
        s.generate(PROMPT, max_tokens=4)
        replied, replied_cpu = time.perf_counter(), time.process_time()
        source = s.calibration_source
    print(json.dumps({"open_s": opened - start, "first_reply_s": replied - opened,
                      "first_reply_cpu_s": replied_cpu - opened_cpu, "calibration": source}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--target", help="target GGUF (default: the embedded one)")
    p.add_argument("--drafter", help="drafter GGUF (default: the embedded target's)")
    p.add_argument("--runs", type=int, default=3, help="starts in all, the first one measuring (default 3)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    forwarded = [f"--threads={args.threads}"] + [f"--{k}={v}" for k in ("target", "drafter") if (v := getattr(args, k))]
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "DFLASH_CALIBRATION_DIR": folder}
        print(f"{'start':>5} {'open s':>8} {'first reply s':>14} {'its CPU s':>10}  calibration")
        for i in range(args.runs):
            done = subprocess.run([sys.executable, __file__, "--child", *forwarded], env=env, capture_output=True,
                                  text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"{i + 1:>5} {r['open_s']:8.2f} {r['first_reply_s']:14.2f} {r['first_reply_cpu_s']:10.2f}  "
                  f"{r['calibration']}")


if __name__ == "__main__":
    main()

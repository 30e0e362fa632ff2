"""What a DSpark drafter's Markov head and confidence scheduling cost per cycle, against a DFlash drafter of
the same size at the same block, and the verify tokens each spends per committed token (issue 11).

Every configuration decodes the same prompts with a fixed block, interleaved prompt by prompt from cold
caches, through the Session (the path users run). Figures are ratios within this one run.

    python scripts/measure_dspark.py --dflash DFLASH.gguf --dspark DSPARK.gguf --threshold 0.5
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from dflash_gguf import Session
from dflash_gguf.bench.suite import load_suite
from dflash_gguf.stats import collect


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dflash", required=True, help="DFlash drafter GGUF for the embedded target")
    ap.add_argument("--dspark", required=True, help="DSpark drafter GGUF of the same size (with a confidence head)")
    ap.add_argument("--threshold", type=float, default=0.5, help="confidence threshold of the scheduled runs")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--limit", type=int, default=2, help="prompts per category of the built-in suite")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    configs = {  # name -> (drafter, generation arguments)
        "dflash": (args.dflash, {}),
        "dspark": (args.dspark, {}),
        f"dspark, threshold {args.threshold}": (args.dspark, {"confidence_threshold": args.threshold}),
        "dspark, adaptive cut": (args.dspark, {"adaptive": True}),
    }
    sessions = {path: Session(drafter=path, n_ctx=1024, n_threads=args.threads, lookup=False)
                for path in {args.dflash, args.dspark}}
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    prompts = load_suite(limit=args.limit)
    try:
        for p in prompts:
            for name, (path, gen) in configs.items():
                s = sessions[path]
                s.reset()
                gen = dict(gen)
                block = None if gen.pop("adaptive", False) else args.block_size
                steps = list(s.stream_chat([{"role": "user", "content": p.prompt}], max_tokens=args.max_tokens,
                                           block_size=block, **gen))
                t = totals[name]
                # cycles that ran the drafter, also those whose drafts the confidences then cut to none
                # (a drafter pass takes milliseconds; a plain cycle's draft_s is the loop's microseconds)
                drafted = [st for st in steps[1:] if st.n_drafted or st.draft_s > 1e-4]
                t["cycles"] += len(drafted)
                t["draft_s"] += sum(st.draft_s for st in drafted)
                t["verify_s"] += sum(st.verify_s for st in drafted)
                t["verify_tokens"] += sum(st.block_size for st in steps[1:])
                t["committed"] += sum(len(st.tokens) for st in steps[1:])
                t["loop_s"] += sum(st.cycle_s for st in steps[1:])
                calibration = collect(steps).calibration
                if calibration is not None:
                    t["conf_slots"] += calibration.slots
                    t["conf_predicted"] += calibration.predicted * calibration.slots
                    t["conf_observed"] += calibration.observed * calibration.slots
            print(f"{p.id}: done", flush=True)
    finally:
        for s in sessions.values():
            s.close()

    base = totals["dflash"]
    print(f"\n{len(prompts)} prompts, block {args.block_size}, {args.max_tokens} tokens, {args.threads} thread(s)\n")
    print("| configuration | draft ms / drafting cycle | vs DFlash | verify tokens / committed token | "
          "committed tok/s (loop) | predicted vs observed acceptance |")
    print("|---|---|---|---|---|---|")
    for name, t in totals.items():
        draft = t["draft_s"] / max(t["cycles"], 1) * 1e3
        ratio = draft / (base["draft_s"] / max(base["cycles"], 1) * 1e3)
        calib = (f"{t['conf_predicted'] / t['conf_slots']:.2f} vs {t['conf_observed'] / t['conf_slots']:.2f} "
                 f"({int(t['conf_slots'])} slots)" if t["conf_slots"] else "-")
        print(f"| {name} | {draft:.2f} | {ratio:.2f}x | {t['verify_tokens'] / t['committed']:.2f} | "
              f"{t['committed'] / t['loop_s']:.1f} | {calib} |")


if __name__ == "__main__":
    main()

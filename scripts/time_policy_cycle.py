"""What the policy and a source's offer put on one decode cycle's path, timed apart from the loop (issue 34).

Two cycles, each repeated over a seeded run: the native drafter's (its source's offer, AdaptivePolicy.choose
and observe over its BlockController, which learns through its acceptance profile) and lookup's (available,
offer, choose, propose, its observe of the commit, the policy's observe). No model runs: the drafter's source
is built around its controller alone, so only the Python a cycle adds is timed. Run it alternately against two
trees (PYTHONPATH=<a git archive of the older one>) in separate processes; it prints the min of `--repeats`
CPU-time timings of `--cycles` cycles, in microseconds per cycle.

    python scripts/time_policy_cycle.py
    PYTHONPATH=/tmp/offers-pre python scripts/time_policy_cycle.py
"""

from __future__ import annotations

import argparse
import time
import timeit

import numpy as np

import dflash_gguf.controller as controller_module
from dflash_gguf.controller import AdaptivePolicy, BlockController, CostModel, CycleTiming
from dflash_gguf.drafter_source import NativeDrafterSource
from dflash_gguf.lookup import LookupSource
from dflash_gguf.sampling import SamplingParams
from dflash_gguf.sources import Commit, Offer

TARGET = {1: 0.010, 2: 0.0125, 4: 0.016, 8: 0.024, 16: 0.0425}
DRAFT = {2: 0.001, 16: 0.003}


def drafter_cycles(n: int) -> None:
    costs = CostModel(dict(TARGET), dict(DRAFT))
    source = NativeDrafterSource.__new__(NativeDrafterSource)  # no drafter: only its offer is on this path
    source.name, source._controller, source._tree = "dflash", BlockController(15, costs), None
    source._offer = Offer("dflash", 0)
    policy = AdaptivePolicy(costs)
    rng = np.random.default_rng(0)
    passes = rng.random((n, 16)) < 0.8
    for i in range(n):
        choice = policy.choose([source.offer(0, i, 15)])
        accepted = 0
        while accepted < choice.n_draft and passes[i, accepted]:
            accepted += 1
        policy.observe(choice, accepted, CycleTiming(choice.n_draft + 1, 0.002, 0.02, 0.0))


def lookup_cycles(n: int) -> None:
    costs = CostModel(dict(TARGET), {1: 1e-5})
    source = LookupSource(max_draft=8)
    text = list(range(100, 160))
    committed = text * 2
    source.observe(Commit(0, list(committed), sequence=committed))
    policy = AdaptivePolicy(costs)
    params, rng = SamplingParams(), np.random.default_rng(0)
    last = text[0]
    for _ in range(n):
        n_past = len(committed)
        k = source.available(last, n_past)
        choice = policy.choose([source.offer(last, n_past, k)] if k else [])
        accepted = []
        if choice.n_draft:
            drafted = source.propose(last, n_past, choice.n_draft, params, rng).tokens.tolist()
            accepted = drafted[: max(1, len(drafted) - 1)]  # all but the last pass: the text repeats
        block = [last] + accepted
        committed += block
        source.observe(Commit(n_past, block, sequence=committed))
        policy.observe(choice, len(accepted), CycleTiming(choice.n_draft + 1, 2e-5, 0.02, 0.0))
        last = text[(text.index(block[-1]) + 1) % len(text)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    for name, run in (("drafter", drafter_cycles), ("lookup", lookup_cycles)):
        # CPU time: on a loaded machine, the time this process was not running is not the cycle's
        best = min(timeit.repeat(lambda: run(args.cycles), number=1, repeat=args.repeats, timer=time.process_time))
        print(f"{name}: {best / args.cycles * 1e6:.2f} us/cycle ({controller_module.__file__})")


if __name__ == "__main__":
    main()

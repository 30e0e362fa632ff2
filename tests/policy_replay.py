"""A seeded trace of the policy's inputs and choices: offers from three kinds of source (the drafter's controller,
a lookup-style profile per match length, an MTP-style profile), acceptances and timings, over a text whose
acceptance changes phase (so the controller sets drafting aside, probes and comes back).

`trace()` replays it on the current code and returns every number the policy and the sources' acceptance
profiles produced; `record()` keeps of each cycle the choice in clear and a digest of every float (the offers'
expected tokens, the drafter's and lookup's estimates, exact to the last bit). tests/replays/policy_trace.json
holds that record of the code before issue 34's item 6, so a refactor of the profiles or the offers shows it
decides the same, cycle for cycle (tests/test_offer_replay.py). Regenerate only for an intended change of
decisions: `python tests/policy_replay.py > tests/replays/policy_trace.json`.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from dflash_gguf.controller import AdaptivePolicy, BlockController, CostModel, CycleTiming
from dflash_gguf.sources import Offer

TARGET = {1: 0.010, 2: 0.0125, 4: 0.016, 8: 0.024, 16: 0.0425}  # Q8_0-like: t(16) = 4.25 steps
DRAFT = {2: 0.001, 16: 0.003}
PHASES = ((0, 0.85), (120, 0.05), (300, 0.9), (420, 0.5))  # (first cycle, P(a drafter draft passes))


def _lookup_profile():
    from dflash_gguf.lookup import lookup_profile

    return lookup_profile()


def _mtp_profile():
    from dflash_gguf.lookup import lookup_profile
    from dflash_gguf.mtp import PRIOR_ACCEPTANCE

    return lookup_profile(prior=PRIOR_ACCEPTANCE)


def trace(cycles: int = 520, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    costs = CostModel(dict(TARGET), dict(DRAFT))
    controller = BlockController(15, costs, probe_after=4, max_probe_after=16)  # probes often
    lookup, mtp = _lookup_profile(), _mtp_profile()
    policy = AdaptivePolicy(costs)
    out = []
    for cycle in range(cycles):
        p_drafter = [p for start, p in PHASES if cycle >= start][-1]
        match = int(rng.integers(2, 40)) if rng.random() < 0.25 else None  # lookup has a match a quarter of the time
        offers = []
        if match is not None:
            offers.append(Offer("lookup", 8, lookup.expected_tokens(match, 8)))
        if cycle % 7 == 0:
            offers.append(Offer("mtp", 3, mtp.expected_tokens(2, 3)))
        if cycle % 5 != 4:  # every fifth cycle the drafter is not on offer: its schedule does not advance
            # as NativeDrafterSource offers it: probing (no bid asked) while its controller has set drafting aside
            offers.append(Offer("dflash", 15, probing=controller.set_aside, schedule=controller))
        choice = policy.choose(offers)
        p = {"lookup": 0.7 if match and match > 10 else 0.2, "mtp": 0.3}.get(choice.source, p_drafter)
        accepted = 0
        while accepted < choice.n_draft and rng.random() < p:
            accepted += 1
        n = choice.n_draft
        block = n + 1
        draft_s = 0.0 if not n else (costs.draft_s(block) if choice.source == "dflash" else 2e-4 * block)
        noise = float(rng.uniform(0.9, 1.1))
        timing = CycleTiming(block, draft_s * noise, costs.verify_s(block) * noise, 1e-5 * n)
        if choice.source == "lookup":
            lookup.observe(match, n, accepted)
        elif choice.source == "mtp":
            mtp.observe(2, n, accepted)
        policy.observe(choice, accepted, timing)
        out.append({
            "offers": [[o.source, o.n_max, None if o.expected is None else list(o.expected)] for o in offers],
            "choice": [choice.source, choice.n_draft, choice.kind.value, choice.reason],
            "accepted": accepted,
            "drafter_expected": controller.expected_tokens(),
            "lookup_acceptance": [lookup.acceptance(length) for length in (2, 5, 12, 40)],
        })
    return out


def record(cycles: list[dict]) -> list[list]:
    """Per cycle: [source, n_draft, kind, reason, accepted, digest of its numbers] (JSON: floats by repr, exact)."""
    out = []
    for c in cycles:
        numbers = json.dumps([c["offers"], c["drafter_expected"], c["lookup_acceptance"]])
        out.append([*c["choice"], c["accepted"], hashlib.sha256(numbers.encode()).hexdigest()[:16]])
    return out


if __name__ == "__main__":
    sys.stdout.write("[\n" + ",\n".join(json.dumps(cycle) for cycle in record(trace())) + "\n]\n")  # a cycle a line

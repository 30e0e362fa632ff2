"""The policy decides the same on a replayed trace (issue 34, item 6): the choices, reasons and acceptances of
tests/policy_replay.py's seeded run, and a digest of every offer's and estimate's floats, equal what the code
before the shared acceptance profile and the offers' numbers produced (tests/replays/policy_trace.json)."""

from __future__ import annotations

import json
from pathlib import Path

from policy_replay import record, trace

RECORDED = Path(__file__).parent / "replays" / "policy_trace.json"


def test_the_policy_decides_the_same_on_the_recorded_trace() -> None:
    want = json.loads(RECORDED.read_text())
    got = json.loads(json.dumps(record(trace())))
    assert len(got) == len(want) == 520
    for cycle, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"cycle {cycle} differs"
    kinds = {(c[0], c[2]) for c in want}  # the trace covers every kind of decision
    assert {("dflash", "draft"), ("dflash", "probe"), ("lookup", "draft"), ("mtp", "draft"), (None, "plain")} <= kinds

"""What a benchmark run measured: one record per generation, summarised per prompt and per category.

Kept apart from the runner so the report writers and the peers share one vocabulary.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Sequence


@dataclass
class Generation:
    """One timed generation of one prompt in one mode."""

    mode: str  # "plain" | "dflash" | a peer's name
    repeat: int
    tokens: list[int]
    prefill_s: float  # prompt processing, as the runtime reports it
    ttft_s: float  # call to first generated token, as the caller sees it
    decode_s: float  # first generated token to the last
    cycles: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0  # cycle wall time not spent in draft or verify: the Python loop's own cost
    acceptance_histogram: list[int] = field(default_factory=list)  # drafting cycles by drafts accepted: 0, 1, ...
    position_drafted: list[int] = field(default_factory=list)  # [k]: cycles that drafted slot k+1
    position_accepted: list[int] = field(default_factory=list)  # [k]: cycles whose slots 1..k+1 all passed
    plain_cycles: int = 0  # cycles the adaptive controller kept plain
    reasons: dict[str, int] = field(default_factory=dict)
    source_accepted: dict[str, int] = field(default_factory=dict)  # accepted drafts by source name  # cycles by Step kind (plain, draft, probe)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first one, over the time after the first one (prefill excluded)."""
        return (self.n_tokens - 1) / self.decode_s if self.decode_s > 0 and self.n_tokens > 1 else 0.0

    @property
    def tau(self) -> float:
        """Acceptance length: drafts accepted per cycle plus the target's own token (plain decoding: 1)."""
        return 1.0 + self.n_accepted / self.cycles if self.cycles else 0.0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["n_tokens"] = self.n_tokens
        out["decode_tokens_per_s"] = self.decode_tokens_per_s
        out["tau"] = self.tau
        return out


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _sum_histograms(histograms: Sequence[Sequence[int]]) -> list[int]:
    """Element-wise sum of count lists of different lengths."""
    width = max((len(h) for h in histograms), default=0)
    return [sum(h[i] for h in histograms if i < len(h)) for i in range(width)]


@dataclass
class PromptResult:
    id: str
    category: str
    runs: list[Generation]

    def of(self, mode: str) -> list[Generation]:
        return [g for g in self.runs if g.mode == mode]

    def tokens_per_s(self, mode: str) -> float | None:
        return _median([g.decode_tokens_per_s for g in self.of(mode)])

    def speedup(self, mode: str = "dflash", base: str = "plain") -> float | None:
        """Median decode tok/s of `mode` over median decode tok/s of `base`."""
        a, b = self.tokens_per_s(mode), self.tokens_per_s(base)
        return a / b if a and b else None

    def outputs_identical(self, mode: str = "dflash", base: str = "plain") -> bool | None:
        """Whether every `mode` generation produced exactly the tokens of the first `base` one."""
        ref, other = self.of(base), self.of(mode)
        if not ref or not other:
            return None
        return all(g.tokens == ref[0].tokens for g in other)

    def summary(self, mode: str) -> dict:
        return mode_summary(self.of(mode))


def mode_summary(runs: Sequence[Generation]) -> dict:
    """Medians and per-cycle figures over some generations of one mode."""
    cycles = sum(g.cycles for g in runs)
    wall = sum(g.draft_s + g.verify_s + g.overhead_s for g in runs)
    return {
        "runs": len(runs),
        "decode_tokens_per_s": _median([g.decode_tokens_per_s for g in runs]),
        "ttft_s": _median([g.ttft_s for g in runs]),
        "prefill_s": _median([g.prefill_s for g in runs]),
        "n_tokens": _median([g.n_tokens for g in runs]),
        "tau": 1.0 + sum(g.n_accepted for g in runs) / cycles if cycles else None,
        "draft_ms_per_cycle": 1e3 * sum(g.draft_s for g in runs) / cycles if cycles else None,
        "verify_ms_per_cycle": 1e3 * sum(g.verify_s for g in runs) / cycles if cycles else None,
        "overhead_ms_per_cycle": 1e3 * sum(g.overhead_s for g in runs) / cycles if cycles else None,
        "overhead_share": sum(g.overhead_s for g in runs) / wall if wall else None,
        "acceptance_rate": (sum(g.n_accepted for g in runs) / sum(g.n_drafted for g in runs))
        if sum(g.n_drafted for g in runs)
        else None,
        "plain_cycle_share": sum(g.plain_cycles for g in runs) / cycles if cycles else None,
        "acceptance_histogram": _sum_histograms([g.acceptance_histogram for g in runs]),
        "acceptance_by_position": _by_position(runs),
    }


def _by_position(runs: Sequence[Generation]) -> list[float]:
    """[k]: of the cycles that drafted slot k+1, the share whose drafts 1..k+1 all passed."""
    drafted = _sum_histograms([g.position_drafted for g in runs])
    accepted = _sum_histograms([g.position_accepted for g in runs])
    accepted += [0] * (len(drafted) - len(accepted))  # slots drafted but never reached
    return [a / n for a, n in zip(accepted, drafted) if n]


@dataclass
class PeerResult:
    """A peer implementation on the same prompts, or the reason it could not run."""

    name: str
    available: bool
    reason: str = ""  # why unavailable, or what was run
    runs: dict[str, list[Generation]] = field(default_factory=dict)  # prompt id -> generations
    identical_to_plain: int | None = None  # prompts whose first generation equals our plain decoding's tokens

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "available": self.available,
            "reason": self.reason,
            "identical_to_plain": self.identical_to_plain,
            "per_prompt": {pid: mode_summary(gs) for pid, gs in self.runs.items()},
            "overall": mode_summary([g for gs in self.runs.values() for g in gs]),
        }


@dataclass
class BenchResult:
    settings: dict
    machine: dict
    prompts: list[PromptResult]
    peers: list[PeerResult] = field(default_factory=list)
    memory: dict = field(default_factory=dict)

    def categories(self) -> list[str]:
        return sorted({p.category for p in self.prompts})

    def category_summary(self, category: str | None) -> dict:
        """Per category (None: all prompts): median speedup over prompts, and each mode's figures."""
        prompts = [p for p in self.prompts if category is None or p.category == category]
        speedups = [s for s in (p.speedup() for p in prompts) if s is not None]
        identical = [p.outputs_identical() for p in prompts]
        return {
            "prompts": len(prompts),
            "median_speedup": _median(speedups),
            "min_speedup": min(speedups) if speedups else None,
            "outputs_identical": sum(1 for x in identical if x),
            "plain": mode_summary([g for p in prompts for g in p.of("plain")]),
            "dflash": mode_summary([g for p in prompts for g in p.of("dflash")]),
            "modes": {m: self._mode_speedups(prompts, m) for m in self.modes() if m != "plain"},
        }

    def modes(self) -> list[str]:
        seen: dict[str, None] = {}
        for p in self.prompts:
            for g in p.runs:
                seen.setdefault(g.mode, None)
        return list(seen)

    @staticmethod
    def _mode_speedups(prompts, mode: str) -> dict:
        """One mode against plain: median and slowest-prompt speedup, identical outputs, lookup's share."""
        speedups = [s for s in (p.speedup(mode) for p in prompts) if s is not None]
        runs = [g for p in prompts for g in p.of(mode)]
        return {
            "median_speedup": _median(speedups),
            "min_speedup": min(speedups) if speedups else None,
            "outputs_identical": sum(1 for p in prompts if p.outputs_identical(mode)),
            "tokens_per_s": _median([g.decode_tokens_per_s for g in runs]),
            "tau": mode_summary(runs)["tau"],
            "lookup_accepted": sum(g.source_accepted.get("lookup", 0) for g in runs),
            "draft_accepted": sum(v for g in runs for k, v in g.source_accepted.items() if k != "lookup"),
            "n_tokens": sum(g.n_tokens for g in runs),
        }

    def to_dict(self) -> dict:
        return {
            "settings": self.settings,
            "machine": self.machine,
            "memory": self.memory,
            "summary": {
                "all": self.category_summary(None),
                **{c: self.category_summary(c) for c in self.categories()},
            },
            "prompts": [
                {
                    "id": p.id,
                    "category": p.category,
                    "speedup": p.speedup(),
                    "outputs_identical": p.outputs_identical(),
                    "plain": p.summary("plain"),
                    "dflash": p.summary("dflash"),
                    "runs": [g.to_dict() for g in p.runs],
                }
                for p in self.prompts
            ],
            "peers": [peer.to_dict() for peer in self.peers],
        }

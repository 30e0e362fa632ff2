"""What a benchmark run measured: one record per generation, summarised per prompt and per category.

Kept apart from the runner so the report writers and the peers share one vocabulary.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Sequence

from dflash_gguf.stats import GenerationStats, SourceStats, StatsBuilder, TreeStats, collect, speedup
from dflash_gguf.lookup import LOOKUP_SOURCE
from dflash_gguf.steps import Step


@dataclass
class Generation:
    """One timed generation of one prompt in one mode.

    Every per-cycle figure is a view of the stats model (dflash_gguf.stats) over `steps`: the Steps the
    Session yielded, or, for a peer that reports its cycles, Steps built from its report. A peer that
    reports only totals (llama-server) gives `reported` instead.
    """

    mode: str  # "plain" | "dflash" | "lookup" | "both" | a peer's name
    repeat: int
    tokens: list[int]
    prefill_s: float  # prompt processing, as the runtime reports it
    ttft_s: float  # call to first generated token, as the caller sees it
    decode_s: float  # first generated token to the last
    steps: list[Step] = field(default_factory=list, repr=False)
    stats: GenerationStats | None = None  # our runs: the Session's own stats of this generation
    reported: SourceStats | None = None  # a peer's drafted / accepted totals, where it has no cycles to give

    @cached_property
    def builder(self) -> StatsBuilder:
        return collect(self.steps)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def cycles(self) -> int:
        return self.builder.cycles

    @property
    def n_drafted(self) -> int:
        return self.reported.n_drafted if self.reported is not None else self.builder.n_drafted

    @property
    def n_accepted(self) -> int:
        return self.reported.n_accepted if self.reported is not None else self.builder.n_accepted

    @property
    def decode_tokens_per_s(self) -> float:
        """The Session's decode rate (prefill excluded); a peer's: tokens after the first over the time after it."""
        if self.stats is not None:
            return self.stats.decode_tokens_per_s
        return (self.n_tokens - 1) / self.decode_s if self.decode_s > 0 and self.n_tokens > 1 else 0.0

    @property
    def loop_tokens_per_s(self) -> float | None:
        """Tokens committed per second inside the decode loop: the rate every speedup divides (our runs only)."""
        return self.stats.loop_tokens_per_s if self.stats is not None else None

    @property
    def tau(self) -> float | None:
        """Acceptance length, the stats model's: tokens committed per cycle (plain decoding: 1)."""
        return self.builder.tau

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "repeat": self.repeat, "tokens": self.tokens, "n_tokens": self.n_tokens,
            "prefill_s": self.prefill_s, "ttft_s": self.ttft_s, "decode_s": self.decode_s,
            "decode_tokens_per_s": self.decode_tokens_per_s, "loop_tokens_per_s": self.loop_tokens_per_s,
            "cycles": self.cycles, "n_drafted": self.n_drafted,
            "n_accepted": self.n_accepted, "tau": self.tau,
            "stats": self.stats.as_dict() if self.stats is not None else None,
        }


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class PromptResult:
    id: str
    category: str
    runs: list[Generation]

    def of(self, mode: str) -> list[Generation]:
        return [g for g in self.runs if g.mode == mode]

    def tokens_per_s(self, mode: str) -> float | None:
        """Median loop rate of a mode's runs (stats.GenerationStats.loop_tokens_per_s)."""
        return _median([r for g in self.of(mode) if (r := g.loop_tokens_per_s) is not None])

    def speedup(self, mode: str = "dflash", base: str = "plain") -> float | None:
        """The median over repeats of stats.speedup(a `mode` run, the `base` run of the same repeat).

        The two runs of a repeat ran next to each other, so a machine whose speed drifts from run to run
        (a shared or throttled CPU: 10-20% between identical runs) cancels out of each ratio.
        """
        base_rates = {g.repeat: g.loop_tokens_per_s for g in self.of(base)}
        ratios = [s for g in self.of(mode) if (s := speedup(g.loop_tokens_per_s, base_rates.get(g.repeat))) is not None]
        return _median(ratios)

    def outputs_identical(self, mode: str = "dflash", base: str = "plain") -> bool | None:
        """Whether every `mode` generation produced exactly the tokens of the first `base` one."""
        ref, other = self.of(base), self.of(mode)
        if not ref or not other:
            return None
        return all(g.tokens == ref[0].tokens for g in other)

    def summary(self, mode: str) -> dict:
        return mode_summary(self.of(mode))


def mode_summary(runs: Sequence[Generation]) -> dict:
    """Medians over some generations of one mode, and their per-cycle figures from one StatsBuilder."""
    builder = collect(step for g in runs for step in g.steps)
    view = builder.stats(wall_s=0.0, n_prompt_tokens=0, n_cached_tokens=0, block_size=None, speculative=True)
    cycles = view.cycles
    reported = [g.reported for g in runs if g.reported is not None]
    drafted = SourceStats(n_drafted=view.n_drafted + sum(r.n_drafted for r in reported),
                          n_accepted=view.n_accepted + sum(r.n_accepted for r in reported))
    histogram = list(view.acceptance_histogram)
    if histogram:
        histogram[0] -= view.plain_cycles  # drafting cycles only: a plain cycle accepts no draft by definition
    overhead = view.loop_s - view.draft_s - view.verify_s  # the loop's own time: bookkeeping, rollback, stops
    return {
        "runs": len(runs),
        "decode_tokens_per_s": _median([g.decode_tokens_per_s for g in runs]),
        "loop_tokens_per_s": _median([r for g in runs if (r := g.loop_tokens_per_s) is not None]),
        "ttft_s": _median([g.ttft_s for g in runs]),
        "prefill_s": _median([g.prefill_s for g in runs]),
        "n_tokens": _median([g.n_tokens for g in runs]),
        "tau": builder.tau,
        "draft_ms_per_cycle": 1e3 * view.draft_s / cycles if cycles else None,
        "verify_ms_per_cycle": 1e3 * view.verify_s / cycles if cycles else None,
        "overhead_ms_per_cycle": 1e3 * overhead / cycles if cycles else None,
        "overhead_share": overhead / view.loop_s if view.loop_s > 0 else None,
        "acceptance_rate": drafted.acceptance_rate,
        "plain_cycle_share": view.plain_cycles / cycles if cycles else None,
        "acceptance_histogram": histogram,  # drafting cycles by drafts accepted: 0, 1, ...
        "acceptance_by_position": list(view.acceptance_by_slot),  # [k]: drafts 1..k+1 all passed, given k+1 drafted
        "per_source": {k: {**vars(v), "acceptance_rate": v.acceptance_rate} for k, v in view.per_source.items()},
        "tokens_by_provenance": dict(view.tokens_by_provenance),
        # a confidence head's mean predicted acceptance against the observed one (stats.Calibration)
        "confidence": asdict(view.confidence) if view.confidence is not None else None,
        **tree_figures(view.tree, cycles),
    }


def tree_figures(tree: TreeStats | None, cycles: int) -> dict:
    """The cycles that verified draft trees (issue 36): their share, rows, depth accepted, wins off the chain."""
    return {
        "tree_cycle_share": (tree.cycles if tree else 0) / cycles if cycles else None,
        "tree_mean_rows": tree.mean_nodes if tree else None,
        "tree_mean_depth": tree.mean_depth if tree else None,
        "tree_off_chain_share": tree.off_chain / tree.cycles if tree else None,
    }


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
        summary = mode_summary(runs)
        return {
            "median_speedup": _median(speedups),
            "min_speedup": min(speedups) if speedups else None,
            "outputs_identical": sum(1 for p in prompts if p.outputs_identical(mode)),
            "tokens_per_s": summary["loop_tokens_per_s"],
            "tau": summary["tau"],
            "per_source": summary["per_source"],
            "lookup_accepted": sum(v["n_accepted"] for k, v in summary["per_source"].items() if k == LOOKUP_SOURCE),
            "draft_accepted": sum(v["n_accepted"] for k, v in summary["per_source"].items() if k != LOOKUP_SOURCE),
            "n_tokens": sum(g.n_tokens for g in runs),
            **{k: summary[k] for k in ("tree_cycle_share", "tree_mean_rows", "tree_mean_depth", "tree_off_chain_share")},
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

"""What the decode loop yields: one typed, keyword-built Step per cycle.

Consumers (Session stats, the TUI, the bench, the server) read these fields, never reason strings:
`kind` says what the cycle was, `provenance` where each committed token came from (its source's name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class StepKind(str, Enum):
    """What a cycle did."""

    PREFILL = "prefill"  # the prompt was decoded; tokens holds the one token sampled from it
    PLAIN = "plain"  # one target step, no draft
    DRAFT = "draft"  # a draft source proposed tokens and the target verified them
    PROBE = "probe"  # a draft the controller tried while it keeps to plain decoding
    CONTEXT_FULL = "context_full"  # nothing decoded: the context has no room left


class TokenSource(str, Enum):
    """The provenance names with a fixed meaning. A drafted token's provenance is its source's name
    (`DraftSource.provenance`), so a new source brings its own with no entry here; these are the target's own
    tokens, the grammar's forced ones and the shipped sources', each one object (`provenance_of`)."""

    PREFILL = "prefill"  # sampled from the prompt's last logits
    PLAIN = "plain"  # the target's own token in a plain cycle
    # the drafters' family: a drafter's tokens carry its kind's name (dflash, dflash2, dspark), which views
    # colour as this one
    DRAFT = "draft"
    LOOKUP = "lookup"  # proposed by the n-gram lookup, accepted by the target
    MTP = "mtp"  # proposed by the target's own MTP heads, accepted by the target
    GRAMMAR = "grammar"  # the only continuation a constraint admits, proposed for free, accepted by the target
    BONUS = "bonus"  # the target's own token after a verified draft

    def __str__(self) -> str:
        return self.value


# names a draft source may not take: its tokens would read as the target's own
TARGET_OWN = frozenset({TokenSource.PREFILL, TokenSource.PLAIN, TokenSource.BONUS})
_FIXED: dict[str, TokenSource] = {s.value: s for s in TokenSource}


def provenance_of(name: str) -> str:
    """The provenance of the tokens a source named `name` got accepted: the name, as its TokenSource where it
    is one of the fixed names (so `is TokenSource.LOOKUP` holds for lookup's tokens)."""
    return _FIXED.get(name, name)


DRAFTED_KINDS = frozenset({StepKind.DRAFT, StepKind.PROBE})


@dataclass(frozen=True)
class TokenLogprob:
    """One committed token's log-probability under the target (its raw logits' log-softmax, before any
    bias, penalty, constraint or filter), and the `top` likeliest (id, logprob) there, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, kw_only=True)
class Step:
    """What one cycle committed. `provenance` names where each token came from (a TokenSource for the target's
    own tokens, else the name of the source that drafted it); `spans` are (text, provenance) pieces whose
    texts join to `text`."""

    kind: StepKind
    tokens: list[int]
    text: str
    provenance: tuple[str, ...] = ()  # one per token
    spans: tuple[tuple[str, str], ...] = ()
    source: str | None = None  # the draft source's name for DRAFT / PROBE cycles
    n_drafted: int = 0
    n_accepted: int = 0
    bonus_token: int | None = None
    block_size: int = 0  # tokens the target decoded this cycle (last committed + drafts); 0 if none
    tree_nodes: int = 0  # rows of the draft tree this cycle verified (anchor included); 0: a linear block or none
    tree_branch: int = 0  # which of the tree's paths was accepted (its leaf's number; 0: the likeliest chain)
    reason: str = ""  # for display only
    draft_s: float = 0.0
    verify_s: float = 0.0  # PREFILL: the prefill time
    rollback_s: float = 0.0
    cycle_s: float = 0.0  # wall time of the cycle inside the loop, consumer time excluded
    finish_reason: str | None = None
    stop_sequence: str | None = None  # the stop string that ended the generation, if one did
    confidences: tuple[float, ...] = field(default=())  # predicted acceptance per drafted token, where known
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the config asks for logprobs

    @property
    def drafted(self) -> bool:
        return self.kind in DRAFTED_KINDS

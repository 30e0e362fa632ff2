"""What the decode loop yields: one typed, keyword-built Step per cycle.

Consumers (Session stats, the TUI, the bench, the server) read these fields, never reason strings:
`kind` says what the cycle was, `provenance` where each committed token came from.
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
    """Where one committed token came from; one vocabulary for every view."""

    PREFILL = "prefill"  # sampled from the prompt's last logits
    PLAIN = "plain"  # the target's own token in a plain cycle
    DRAFT = "draft"  # proposed by the native drafter, accepted by the target
    LOOKUP = "lookup"  # proposed by the n-gram lookup, accepted by the target
    MTP = "mtp"  # proposed by the target's own MTP heads, accepted by the target
    GRAMMAR = "grammar"  # the only continuation a constraint admits, proposed for free, accepted by the target
    BONUS = "bonus"  # the target's own token after a verified draft


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
    """What one cycle committed. `spans` are (text, TokenSource) pieces whose texts join to `text`."""

    kind: StepKind
    tokens: list[int]
    text: str
    provenance: tuple[TokenSource, ...] = ()  # one per token
    spans: tuple[tuple[str, TokenSource], ...] = ()
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

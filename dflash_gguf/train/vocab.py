"""The reduced draft vocabulary: the target tokens the drafter can propose (`d2t`).

The drafter's LM head is its largest cost on a CPU; keeping the most frequent tokens of the
target's own responses keeps nearly all of what it writes at a fraction of the rows.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from .data import FeatureCache
from .prompts import Prompt


def token_counts(cache: FeatureCache, n_vocab: int) -> np.ndarray:
    """(n_vocab,) occurrences of each token in the cached responses."""
    counts = np.zeros(n_vocab, dtype=np.int64)
    for r in cache.records:
        tokens, _ = cache.load(r)
        counts += np.bincount(tokens[r.response_start :], minlength=n_vocab)
    return counts


def prompt_token_counts(target_path: Path, prompts: Sequence[Prompt], n_vocab: int) -> np.ndarray:
    """(n_vocab,) occurrences of each token in the prompt texts, tokenized by the target itself."""
    from ..target import Target

    counts = np.zeros(n_vocab, dtype=np.int64)
    with Target.open(target_path, n_ctx=64, n_batch=8, n_threads=1) as target:
        for p in prompts:
            counts += np.bincount(target.vocab.tokenize(p.prompt, add_special=False, parse_special=False), minlength=n_vocab)
    return counts


def choose_draft_vocab(
    response_counts: np.ndarray, prompt_counts: np.ndarray, size: int, always: Sequence[int], prompt_weight: float = 0.25
) -> np.ndarray:
    """Sorted absolute target ids of the `size` highest-scoring tokens, `always` included
    (end-of-generation tokens: a drafter that cannot propose the end cannot draft past it).

    Score: frequency in the cached responses plus `prompt_weight` x frequency in all training
    prompts, which the responses echo (names, numbers, identifiers) and which are far more text
    than the responses generated so far. Ties go to the lower id, the earlier BPE merge.
    """
    size = min(size, len(response_counts))
    score = response_counts / max(1, response_counts.sum()) + prompt_weight * prompt_counts / max(1, prompt_counts.sum())
    order = np.argsort(-score, kind="stable")
    keep = list(dict.fromkeys([int(t) for t in always] + [int(t) for t in order]))[:size]
    return np.sort(np.asarray(keep, dtype=np.int64))


def coverage(counts: np.ndarray, d2t: np.ndarray) -> float:
    """Share of response tokens the draft vocabulary can propose."""
    total = counts.sum()
    return float(counts[d2t].sum() / total) if total else 0.0


def target_to_draft(d2t: np.ndarray, n_vocab: int) -> np.ndarray:
    """(n_vocab,) draft row of each target id, -1 where the draft vocabulary lacks it."""
    t2d = np.full(n_vocab, -1, dtype=np.int64)
    t2d[d2t] = np.arange(len(d2t))
    return t2d

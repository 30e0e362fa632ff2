"""Lookup drafts: continuations copied from earlier in the context, found by an incremental n-gram index.

Much desktop work re-emits text the model already has (editing code in the prompt, quoting a document,
rewriting a message). There the tokens that followed the last occurrence of the current suffix are a
free draft: no forward pass, only a dictionary lookup. Upstream llama.cpp has five variants of this
(`common/ngram-map.cpp`: ngram-simple scans the history backwards, ngram-map-k keeps keys with hit counts;
`ngram-mod.cpp`: one fixed-size hashed table of n-grams to their next token; `ngram-cache.cpp`: n-gram ->
next-token frequency tables). This index keeps, for a few n-gram sizes, every position an n-gram occurred
at, appended as tokens are committed: each new token costs one insertion per size, and a query costs at
most a fixed number of dictionary reads and token comparisons, however long the context is. `ops` counts
both, so that tests can prove it without timing anything.

The draft length is not the index's business: its `AcceptanceProfile` (`lookup_profile`) learns, per
match-length bucket, how often lookup drafts pass, and the policy turns that into the length that pays most
on this machine.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .acceptance import AcceptanceProfile
from .controller import DraftTimes
from .sampling import SamplingParams
from .sources import Candidate, Commit, DraftSource, Offer
from .tree import DraftTree, grow_tree

DEFAULT_SIZES = (2, 3, 4, 8)  # n-gram sizes indexed; queried longest first
DEFAULT_CANDIDATES = 4  # most recent occurrences of the matched n-gram compared by their full match length
DEFAULT_MAX_MATCH = 32  # a match is measured backwards at most this far (longer is as good as this)
MATCH_BUCKETS = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # lower bounds of the match-length buckets acceptance is kept by


@dataclass(frozen=True)
class Match:
    """An earlier occurrence of the context's suffix: its continuation starts at `pos`, `length` tokens agree."""

    pos: int
    length: int


class NgramIndex:
    """Positions of every n-gram (n in `sizes`) of a growing token sequence, keyed by the n-gram.

    The sequence is what the target has committed (prompt and generated tokens). Its owner holds it (in a
    Session, the loop's CacheState) and the index only reads it: it keeps its tables and how many positions
    they cover, never a copy of the tokens. `extend_to` indexes what the owner appended, `truncate` undoes
    a tail the owner is about to drop (a new prompt that shares only a prefix), `match` finds where the
    suffix `tokens[-(n-1):] + [last]` occurred before, and `continuation` copies what followed it.
    """

    def __init__(
        self,
        tokens: Sequence[int] = (),
        sizes: Sequence[int] = DEFAULT_SIZES,
        *,
        candidates: int = DEFAULT_CANDIDATES,
        max_match: int = DEFAULT_MAX_MATCH,
    ) -> None:
        sizes = tuple(sorted(set(int(n) for n in sizes)))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"n-gram sizes must be integers >= 1, got {sizes!r}")
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {candidates}")
        if max_match < sizes[-1]:
            raise ValueError(f"max_match must be >= the largest n-gram size {sizes[-1]}, got {max_match}")
        self.sizes = sizes
        self.candidates = candidates
        self.max_match = max_match
        self.tokens = tokens  # the owner's sequence, read only: positions 0..len(self)-1 are indexed
        self._n = 0
        # n -> n-gram -> ascending positions of the token that followed each occurrence
        self._tables: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in sizes}
        self.ops = 0  # dictionary operations and token comparisons so far (a cost counter for tests)

    def __len__(self) -> int:
        return self._n

    # -- building ---------------------------------------------------------------------------------

    def attach(self, tokens: Sequence[int]) -> None:
        """Read another sequence from now on; only while nothing is indexed (the tables describe one sequence)."""
        if self._n:
            raise RuntimeError(f"the n-gram index covers {self._n} positions of another sequence: truncate it to 0 first")
        self.tokens = tokens

    def extend_to(self, end: int) -> None:
        """Index positions len(self)..end-1, which the sequence holds by now: each closes one n-gram per size."""
        seq = self.tokens
        if end > len(seq):
            raise ValueError(f"cannot index up to {end}: the sequence holds {len(seq)} tokens")
        tables = self._tables
        for i in range(self._n, end):
            for n in self.sizes:
                if i >= n:
                    tables[n].setdefault(tuple(seq[i - n : i]), []).append(i)
                    self.ops += 1
        self._n = max(self._n, end)

    def truncate(self, n: int) -> None:
        """Forget positions >= n, undoing exactly their insertions (newest first). It reads the n-grams it
        undoes, so the owner drops the tokens after this, never before; n = 0 empties the tables unread."""
        if n < 0:
            raise ValueError(f"truncate needs n >= 0, got {n}")
        if n >= self._n:
            return
        if n == 0:
            for table in self._tables.values():
                table.clear()
            self._n = 0
            return
        seq = self.tokens
        if len(seq) < self._n:
            raise RuntimeError(f"the sequence holds {len(seq)} tokens and the index {self._n}: "
                               "truncate the index before the sequence")
        for i in range(self._n - 1, n - 1, -1):
            for size in self.sizes:
                if i >= size:
                    key = tuple(seq[i - size : i])
                    table = self._tables[size]
                    positions = table[key]
                    positions.pop()  # the newest occurrence is i's: positions are appended in order
                    if not positions:
                        del table[key]
                    self.ops += 1
        self._n = n

    # -- querying ---------------------------------------------------------------------------------

    def match(self, last: int) -> Match | None:
        """The best earlier occurrence of the suffix ending in `last` (the token after `tokens`), if any.

        The longest indexed n-gram size that occurs wins; among its `candidates` most recent occurrences,
        the one that agrees furthest back (up to max_match), the most recent on a tie.
        """
        found = self.matches(last, stop_at_max=True)
        return found[0] if found else None

    def matches(self, last: int, *, stop_at_max: bool = False) -> list[Match]:
        """The `candidates` most recent occurrences of the longest indexed n-gram the suffix ending in `last`
        ends in, best first (`match`'s order); stop_at_max: stop at the first that agrees max_match back."""
        seq, end = self.tokens, self._n
        length = end + 1  # of the virtual sequence tokens[:end] + [last]
        for n in reversed(self.sizes):
            if n > length:
                continue
            key = tuple(seq[length - n : end]) + (int(last),) if n > 1 else (int(last),)
            positions = self._tables[n].get(key)
            self.ops += 1
            if not positions:
                continue
            found: list[Match] = []
            for pos in reversed(positions[-self.candidates :]):
                found.append(Match(pos, n + self._extend_back(pos - n - 1, length - n - 1, self.max_match - n)))
                if stop_at_max and found[-1].length >= self.max_match:
                    break
            return sorted(found, key=lambda m: -m.length)  # stable: the most recent first on a tie
        return []

    def _extend_back(self, i: int, j: int, limit: int) -> int:
        """How many tokens agree going backwards from seq[i] and seq[j] (both indexed, j < len(self)), at most limit."""
        seq = self.tokens
        k = 0
        while k < limit and i - k >= 0 and seq[i - k] == seq[j - k]:
            k += 1
        self.ops += k + 1
        return k

    def continuation(self, match: Match, last: int, n: int) -> list[int]:
        """The n tokens that follow the match, read as a copy that may run into the text it is producing.

        Past the end of the committed tokens the copy continues from [last] + the draft itself, so a
        repeating pattern ("a b a b ...") drafts as far as asked.
        """
        seq, end = self.tokens, self._n
        tail = [int(last)]
        out: list[int] = []
        for j in range(n):
            p = match.pos + j
            tok = seq[p] if p < end else tail[p - end]
            out.append(tok)
            tail.append(tok)
        self.ops += n
        return out


def match_bucket(length: int) -> int:
    """The index of the match-length bucket `length` falls in (acceptance is learnt per bucket)."""
    return max(0, bisect.bisect_right(MATCH_BUCKETS, length) - 1)


def _default_prior(bucket: int) -> float:
    """P(a lookup token passes) before any evidence: longer matches are likelier to continue."""
    return min(0.95, 0.5 + 0.06 * bucket)


def lookup_profile(prior: float | None = None) -> AcceptanceProfile:
    """How often lookup tokens pass, by the match length at the slot they were drafted in: slot j of a draft
    from a match of length L continues a match of length L + j, so acceptance is learnt per bucket of that
    length (MATCH_BUCKETS), decayed per draft judged. prior: P(pass) before any evidence, one for every length
    (None: rising with the length, since longer matches are likelier to continue)."""
    priors = [_default_prior(b) for b in range(len(MATCH_BUCKETS))] if prior is None else prior
    return AcceptanceProfile(len(MATCH_BUCKETS), prior=priors, strength=4.0, memory=0.95, slot_of=match_bucket)


def continuation_tree(index: NgramIndex, last: int, found: Sequence[Match], depth: int, rows: int,
                      acceptance: Callable[[int], float]) -> DraftTree:
    """A draft tree of `rows` rows (the anchor `last` included) from the trie of what followed each occurrence
    in `found` (NgramIndex.matches, best first), `depth` tokens each.

    A node's chance of being the target's token given its parent was is the lookup acceptance at its match
    length (acceptance(length): the lookup profile's, learnt on the best match's drafts) times its share of the
    occurrences through its parent, the best match weighing as much as all the others together plus one:
    the first chain is then the best match's continuation, the linear draft, and the others branch off it
    where they part from it.
    """
    weights = [float(len(found))] + [1.0] * (len(found) - 1)
    trie: dict[tuple[int, ...], dict[int, float]] = {}
    for m, w in zip(found, weights):
        tokens = index.continuation(m, last, depth)
        for d, tok in enumerate(tokens):
            kids = trie.setdefault(tuple(tokens[:d]), {})
            kids[tok] = kids.get(tok, 0.0) + w
    length = found[0].length

    def children(path: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        kids = trie.get(path[1:], {})
        order = sorted(kids, key=lambda t: -kids[t])
        total = sum(kids.values())
        a = acceptance(length + len(path) - 1)
        return np.array(order, dtype=np.int64), np.array([a * kids[t] / total for t in order])

    return grow_tree(last, children, depth, rows)


LOOKUP_SOURCE = "lookup"
DEFAULT_MAX_DRAFT = 32


class LookupSource(DraftSource):
    """N-gram lookup as a draft source: free, deterministic proposals copied from the context.

    It indexes every committed token (prompt chunks and accepted cycles) as the loop reports them, reading
    them from the loop's one copy (Commit.sequence), so a query never rescans the context and no token is
    held twice. Proposals are point masses: with sampling each token is accepted
    with the target's own probability of it (q = 1 at the drafted token), which keeps the output
    distributed exactly as the target's. What passed is learnt per match length (`stats`), from the
    commits themselves, and what its proposals take it times itself (`draft_times`): its `offer` says what
    each length is expected to commit and what drafting it takes, for the policy to price.

    tree_nodes > 0 (a Session's tree_nodes, where its target verifies trees): where the matched n-gram was
    followed by different continuations, a cycle of n drafts proposes a tree of up to n + 1 rows of them
    (`continuation_tree`: as many rows as the block the policy priced) beside the linear draft.
    """

    name = LOOKUP_SOURCE
    needs_features = False

    def __init__(self, *, max_draft: int = DEFAULT_MAX_DRAFT, index: NgramIndex | None = None,
                 stats: AcceptanceProfile | None = None, tree_nodes: int = 0) -> None:
        if not isinstance(max_draft, int) or max_draft < 1:
            raise ValueError(f"max_draft must be an integer >= 1, got {max_draft!r}")
        if not isinstance(tree_nodes, int) or tree_nodes < 0 or tree_nodes == 1:
            raise ValueError(f"tree_nodes must be 0 or an integer >= 2, got {tree_nodes!r}")
        self.max_draft = max_draft
        self.tree_nodes = tree_nodes
        self.index = index if index is not None else NgramIndex()  # (an empty index is falsy)
        self.stats = stats or lookup_profile()  # what it learns of its own drafts: it owns it
        self.draft_times = DraftTimes()  # and what they take
        self._match: tuple[int, int, list[Match]] | None = None  # (last, n_past, matches best first) of the last query
        self._proposed: tuple[int, int, list[int]] | None = None  # (n_past, match length, tokens)

    def cached(self) -> int:
        return len(self.index)

    def truncate(self, n: int) -> None:
        if n < len(self.index):
            self.index.truncate(n)
        self._match = None
        self._proposed = None

    def match(self, last: int, n_past: int) -> Match | None:
        """The current match (cached per cycle: available() and propose() share one query)."""
        if self._match is None or self._match[:2] != (last, n_past):
            if n_past != len(self.index):
                raise RuntimeError(f"lookup index holds {len(self.index)} positions, the loop is at {n_past}")
            found = self.index.matches(last) if self.tree_nodes else [m for m in [self.index.match(last)] if m]
            self._match = (last, n_past, found)
        found = self._match[2]
        return found[0] if found else None

    def available(self, last: int, n_past: int) -> int:
        return self.max_draft if self.match(last, n_past) is not None else 0

    def offer(self, last: int, n_past: int, n_max: int) -> Offer:
        """Expected tokens for verifying n lookup tokens now, n = 0..n_max, from what passed at this match length."""
        m = self.match(last, n_past)
        expected = [1.0] if m is None else self.stats.expected_tokens(m.length, min(n_max, self.max_draft))
        return Offer(self.name, n_max, expected, self.draft_times.per_length(len(expected) - 1))

    def propose(
        self, last: int, n_past: int, n_draft: int, params: SamplingParams, rng: np.random.Generator
    ) -> Candidate:
        t0 = time.perf_counter()
        m = self.match(last, n_past)
        if m is None:
            raise RuntimeError("lookup has no match to propose from (available() was 0)")
        tokens = self.index.continuation(m, last, n_draft)
        self._proposed = (n_past, m.length, tokens)
        ids = np.asarray(tokens, dtype=np.int64)
        found = self._match[2]
        tree = None
        if self.tree_nodes and len(found) > 1 and n_draft > 1:
            tree = continuation_tree(self.index, last, found, n_draft, min(self.tree_nodes, n_draft + 1),
                                     self.stats.acceptance)
        self.draft_times.observe(n_draft + 1, time.perf_counter() - t0)
        # tokens: the linear draft the policy priced, verified where the tree is one path or cannot be verified
        return Candidate(self.name, ids, point_mass=True, tree=None if tree is None or tree.is_path else tree)

    def observe(self, commit: Commit) -> None:
        index = self.index
        if commit.sequence is not index.tokens:
            if commit.sequence is None:
                raise ValueError("lookup reads the committed tokens from Commit.sequence, and this commit has none")
            index.attach(commit.sequence)
        if commit.start != len(index):
            raise RuntimeError(f"lookup index out of order: commit at {commit.start}, index at {len(index)}")
        if self._proposed is not None and self._proposed[0] == commit.start:
            _, length, drafted = self._proposed
            got = list(commit.tokens[1:])
            n_accepted = 0
            while n_accepted < min(len(drafted), len(got)) and drafted[n_accepted] == got[n_accepted]:
                n_accepted += 1
            self.stats.observe(length, len(drafted), n_accepted)
        self._proposed = None
        self._match = None
        index.extend_to(commit.start + len(commit.tokens))

"""Draft trees: the drafter's candidates shaped into a tree, verified in one batch, walked by the target.

A tree grows from candidate lists: after a node at depth d holding a token, the drafter's candidates for
slot d + 1, best first, with its probability of each (`Candidates`). A DFlash block predicts every slot at
once, so its candidates at a slot are the same whatever was chosen before (`SlotCandidates`); DFlash 2's
selector scores each candidate given the previous slot's pick (`PairCandidates`), and DSpark's Markov head
re-biases each slot's logits with the previous token (`MarkovCandidates`): there a node's children depend
on its own token. Lookup grows its trees from a trie of the continuations seen after the current n-gram
(lookup.py). Each node's chance of being the target's token, given that its parent was, comes from an
acceptance model that learns from what the target accepted; the tree keeps the `budget` nodes whose paths
are most likely accepted (best first), so its expected committed tokens, 1 + the sum of every node's path
probability, is as large as that budget allows.

Rows are in depth-first order, children most likely first: the top-1 chain is rows 0..m, so a tree that is
one path is exactly a linear block [last, d1..dm]. Each root-to-leaf path is one sequence id of a unified KV
cache; a node carries the ids of every leaf below it, so shared prefixes are decoded once.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

from .kinds.head import Candidates, SlotCandidates
from .sampling import sample_token
from .target import state_seq_get, state_seq_set

if TYPE_CHECKING:
    from .drafter import Drafter
    from .memory import TargetMemory
    from .target import Target


@dataclass(frozen=True)
class DraftTree:
    """A verify batch shaped as a tree. Row 0 is the anchor (the last committed token, depth 0).

    tokens/parents/depths/ranks: per row (parents[0] = -1; ranks[i]: the candidate rank of row i's token
    at its slot, -1 for the anchor). probs[i]: the chance row i's path is accepted (1 for the anchor), so a
    verify of the tree is expected to commit 1 + sum(probs[1:]) tokens, the bonus included.
    leaves: the rows without children, in row order; the sequence id of
    leaf j is j. seq_ranges[i]: the leaf ids below row i, as (first, last + 1).
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ranks: tuple[int, ...]
    leaves: tuple[int, ...]
    seq_ranges: tuple[tuple[int, int], ...]
    probs: tuple[float, ...]

    def __post_init__(self) -> None:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            kids[self.parents[i]].append(i)
        object.__setattr__(self, "_children", tuple(tuple(k) for k in kids))  # the walks ask for them per row

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_path(self) -> bool:
        """One root-to-leaf path: a linear block."""
        return len(self.leaves) == 1

    @property
    def expected_tokens(self) -> float:
        """Tokens a verify of this tree is expected to commit, the bonus included."""
        return 1.0 + sum(self.probs[1:])

    @property
    def first_leaf(self) -> int:
        """The end of the first path: rows 0..first_leaf are the likeliest chain, a linear block."""
        return self.leaves[0]

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    def children(self, row: int) -> tuple[int, ...]:
        """Its child rows, likeliest first."""
        return self._children[row]

    def path(self, row: int) -> list[int]:
        """Rows from the anchor down to `row`."""
        out = []
        while row >= 0:
            out.append(row)
            row = self.parents[row]
        return out[::-1]

    def seq_ids(self, row: int) -> range:
        first, end = self.seq_ranges[row]
        return range(first, end)


def drafter_candidates(drafter: "Drafter", k: int) -> Callable[[np.ndarray, int], Candidates]:
    """How one pass of this drafter (Drafter.draft's output after an anchor) is read as a tree's candidates:
    its kind's head says (Head.tree_candidates)."""
    return lambda out, anchor: drafter.head.tree_candidates(out, anchor, k)


def build_tree(anchor: int, ids: np.ndarray, accept: np.ndarray, budget: int) -> DraftTree:
    """The `budget`-row tree (anchor included) with the largest expected accepted depth, where a slot's
    candidates are the same after any parent: ids (D, K), best first, for slots 1..D; accept (D, K): P(the
    target's token at slot d is candidate k | the slots before were accepted)."""
    ids = np.asarray(ids)
    accept = np.asarray(accept, dtype=np.float64)
    if ids.ndim != 2 or accept.shape != ids.shape:
        raise ValueError(f"ids and accept must both be (slots, k), got {ids.shape} and {accept.shape}")
    return grow_tree(anchor, lambda path: (ids[len(path) - 1], accept[len(path) - 1]), ids.shape[0], budget)


def grow_tree(anchor: int, children: Callable[[tuple[int, ...]], tuple[np.ndarray, np.ndarray]], n_slots: int,
              budget: int) -> DraftTree:
    """The `budget`-row tree (anchor included) with the largest expected accepted depth.

    children(path): (ids, accept) of the candidates after the node whose path's tokens, the anchor first, are
    `path` (its depth len(path) - 1 < n_slots), best first; accept: P(the target's token is that candidate |
    the node was accepted). A node's path
    probability is the product of its path's accept values; nodes are added best first (a node's first child
    and next sibling become candidates once it is in), which is optimal where accept falls with the rank, as a
    drafter's ranking makes it. children is asked once per node added (above depth n_slots).
    """
    if budget < 1:
        raise ValueError(f"a tree needs at least its anchor row (budget >= 1), got {budget}")
    # a node: (parent node, depth, rank among its parent's candidates, token); node 0 is the anchor
    nodes: list[tuple[int, int, int, int]] = [(-1, 0, -1, int(anchor))]
    paths: list[tuple[int, ...]] = [(int(anchor),)]
    score: list[float] = [1.0]
    offered: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # node -> its children's (ids, accept)
    # (-path probability, tie order, parent node, rank): a candidate at depth(parent) + 1
    heap: list[tuple[float, int, int, int]] = []
    order = 0

    def push(parent: int, rank: int) -> None:
        nonlocal order
        if nodes[parent][1] >= n_slots:
            return
        if parent not in offered:
            offered[parent] = children(paths[parent])
        ids, accept = offered[parent]
        if rank < len(ids):
            prob = score[parent] * float(accept[rank])
            if prob > 0.0:  # a candidate that cannot be accepted is never worth a row
                heapq.heappush(heap, (-prob, order, parent, rank))
                order += 1

    push(0, 0)
    while heap and len(nodes) < budget:
        neg, _, parent, rank = heapq.heappop(heap)
        ids = offered[parent][0]
        token = int(ids[rank])
        if token not in ids[:rank]:  # siblings hold distinct tokens (a candidate list may repeat one)
            nodes.append((parent, nodes[parent][1] + 1, rank, token))
            paths.append(paths[parent] + (token,))
            score.append(-neg)
            push(len(nodes) - 1, 0)  # its first child
        push(parent, rank + 1)  # its next sibling
    return _depth_first(nodes, score)


def _depth_first(nodes: list[tuple[int, int, int, int]], score: list[float]) -> DraftTree:
    """Rows in depth-first order, the likelier child first; leaves numbered in that order."""
    kids: list[list[int]] = [[] for _ in nodes]
    for n in range(1, len(nodes)):
        kids[nodes[n][0]].append(n)
    row_of: dict[int, int] = {}
    tokens, parents, depths, ranks, probs = [], [], [], [], []
    stack = [0]
    while stack:
        n = stack.pop()
        parent, depth, rank, token = nodes[n]
        row_of[n] = len(tokens)
        tokens.append(token)
        parents.append(-1 if parent < 0 else row_of[parent])
        depths.append(depth)
        ranks.append(rank)
        probs.append(score[n])
        stack.extend(sorted(kids[n], key=lambda c: score[c]))  # the likeliest child is popped first
    has_child = [False] * len(tokens)
    for p in parents[1:]:
        has_child[p] = True
    leaves = tuple(i for i in range(len(tokens)) if not has_child[i])
    leaf_id = {row: j for j, row in enumerate(leaves)}
    first = [0] * len(tokens)
    end = [0] * len(tokens)
    for i in reversed(range(len(tokens))):  # children come after their parent: fold leaf ranges upwards
        if not has_child[i]:
            first[i], end[i] = leaf_id[i], leaf_id[i] + 1
    for i in reversed(range(1, len(tokens))):
        p = parents[i]
        if end[p] == 0:
            first[p], end[p] = first[i], end[i]
        else:
            first[p], end[p] = min(first[p], first[i]), max(end[p], end[i])
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths), tuple(ranks), leaves,
                     tuple(zip(first, end)), tuple(probs))


def walk_greedy(tree: DraftTree, target_token: Callable[[int], int]) -> tuple[list[int], int]:
    """(accepted path rows, anchor first; bonus token): follow the target's token down the tree.

    target_token(row): the target's greedy token after row (the argmax of the row's logits); it is asked
    only of rows on the accepted path.
    """
    row = 0
    path = [0]
    while True:
        token = target_token(row)
        nxt = next((c for c in tree.children(row) if tree.tokens[c] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        row = nxt


def walk_sampled(tree: DraftTree, probs: np.ndarray, rng: np.random.Generator) -> tuple[list[int], int]:
    """(accepted path rows, next token) by multi-candidate rejection sampling; probs (rows, V): the target's
    distribution after each row. The committed tokens are distributed exactly as sampling from the target.

    At each row the children are tried in turn, each a point-mass proposal (the tree's candidates are chosen,
    not drawn): child x is accepted with probability r(x), where r is the target's distribution with the
    children rejected so far removed and renormalised; a rejected child's mass is removed. Then
    P(x_i is taken) = r_0 (x_i) (the chance each earlier one was refused, times x_i's share of what remains):
    the target's own probability, as SpecInfer's recursive residuals give with q a point mass. When every
    child is refused, the next token is drawn from what remains.
    """
    row = 0
    path = [0]
    while True:
        residual = np.asarray(probs[row], dtype=np.float64).copy()
        mass = float(residual.sum())
        for child in tree.children(row):
            token = tree.tokens[child]
            if rng.random() * mass < residual[token]:
                path.append(child)
                row = child
                break
            mass -= residual[token]
            residual[token] = 0.0
        else:
            if residual.sum() <= 0.0:  # only rounding can empty it: every child held all the mass
                residual = np.asarray(probs[row], dtype=np.float64)
            return path, sample_token(residual, rng)


class TreePrices(Protocol):
    """What sizing a tree reads of the cost model (controller.VerifyCosts has these; declared here so that the
    controller, the sources and the trees import no circle)."""

    def tree_verify_s(self, n_rows: int) -> float: ...

    def draft_s(self, block_tokens: int) -> float: ...

class AcceptanceModel:
    """P(the target's token at slot d is the drafter's rank-k candidate | the slots before were accepted).

    Learned from verified cycles: each tells, for slots 1..accepted+1, which rank the target's token had
    among the drafter's candidates (or none). Counts decay, so the profile follows the text; each slot's
    rates shrink towards the rates pooled over slots, and those towards a prior that falls with the rank.
    """

    def __init__(self, n_slots: int, k: int, *, memory: float = 0.995, pool_strength: float = 8.0,
                 prior: Sequence[float] | None = None, prior_strength: float = 4.0) -> None:
        if n_slots < 1 or k < 1:
            raise ValueError(f"need n_slots >= 1 and k >= 1, got {n_slots}, {k}")
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"memory must be in (0, 1], got {memory}")
        self.n_slots, self.k = n_slots, k
        self._memory = memory
        self._pool_strength = pool_strength
        self._prior_strength = prior_strength
        self._prior = np.asarray(prior if prior is not None else [0.5 / 2**r for r in range(k)], dtype=np.float64)
        if self._prior.shape != (k,) or self._prior.sum() >= 1.0 or np.any(self._prior < 0):
            raise ValueError("prior: k probabilities summing below 1")
        self._hits = np.zeros((n_slots, k))  # decayed count of cycles whose target token had rank r at slot d
        self._tried = np.zeros(n_slots)  # decayed count of cycles that judged slot d

    def table(self) -> np.ndarray:
        """(n_slots, k) acceptance per slot and rank, as currently estimated."""
        strength = self._prior_strength
        pooled = (self._hits.sum(axis=0) + strength * self._prior) / (self._tried.sum() + strength)
        return (self._hits + self._pool_strength * pooled) / (self._tried[:, None] + self._pool_strength)

    def observe(self, target_ranks: Sequence[int]) -> None:
        """One verified cycle: the target's token's rank at slots 1, 2, ... (k or more: not a candidate),
        as far as the accepted prefix reaches (the accepted slots, then the first rejected one)."""
        self._hits *= self._memory
        self._tried *= self._memory
        for d, r in enumerate(target_ranks[: self.n_slots]):
            self._tried[d] += 1.0
            if 0 <= r < self.k:
                self._hits[d, r] += 1.0


class CalibratedAcceptance:
    """P(a candidate is the target's token | the slots before were accepted), from the drafter's own probability.

    The drafter's probability says how sure it is at this cycle, which a per-rank table cannot; but it is not
    calibrated (a block drafter is not conditioned on the slots before). This learns the map from its
    probability to the target's acceptance, per probability bin and slot group, from verified cycles: for
    slots 1..accepted+1, each candidate was either the target's token or not. Bins start at the identity.
    """

    EDGES = np.array([0.01, 0.03, 0.06, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    SLOT_GROUPS = (1, 2, 3, 5)  # first slot of each group: 1, 2, 3-4, 5 and later

    def __init__(self, n_slots: int, *, memory: float = 0.998, prior_strength: float = 4.0) -> None:
        if n_slots < 1:
            raise ValueError(f"need n_slots >= 1, got {n_slots}")
        if not 0.0 < memory <= 1.0:
            raise ValueError(f"memory must be in (0, 1], got {memory}")
        bins = len(self.EDGES) + 1
        lo = np.concatenate([[0.0], self.EDGES])
        hi = np.concatenate([self.EDGES, [1.0]])
        self._prior = (lo + hi) / 2
        self._prior_strength = prior_strength
        self._memory = memory
        self._group = np.searchsorted(self.SLOT_GROUPS, np.arange(1, n_slots + 1), side="right") - 1
        self._hits = np.zeros((len(self.SLOT_GROUPS), bins))
        self._tried = np.zeros((len(self.SLOT_GROUPS), bins))
        self.n_slots = n_slots

    def _bins(self, q: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.EDGES, q, side="right")

    def _rate(self) -> np.ndarray:
        return (self._hits + self._prior_strength * self._prior) / (self._tried + self._prior_strength)

    def accept(self, q: np.ndarray) -> np.ndarray:
        """(D, K) acceptance of candidates the drafter gave probabilities q (D, K), slots 1..D."""
        return self._rate()[self._group[: q.shape[0], None], self._bins(q)]

    def accept_at(self, slot: int, q: np.ndarray) -> np.ndarray:
        """(K,) acceptance of the candidates of one slot (1..n_slots), drafter probabilities q (K,)."""
        return self._rate()[self._group[slot - 1], self._bins(q)]

    def observe(self, q: np.ndarray, target_ranks: Sequence[int]) -> None:
        """One verified cycle: q (D, K) its candidates' drafter probabilities; target_ranks as AcceptanceModel's."""
        self._hits *= self._memory
        self._tried *= self._memory
        k = q.shape[1]
        for d, r in enumerate(target_ranks[: q.shape[0]]):
            g = self._group[d]
            b = self._bins(q[d])
            np.add.at(self._tried[g], b, 1.0)
            if 0 <= r < k:
                self._hits[g, b[r]] += 1.0


def target_ranks(ids: np.ndarray, continuation: Sequence[int]) -> list[int]:
    """The rank of each target token among its slot's candidates (k where it is none of them)."""
    k = ids.shape[1]
    out = []
    for d, tok in enumerate(continuation[: ids.shape[0]]):
        hit = np.flatnonzero(ids[d] == tok)
        out.append(int(hit[0]) if hit.size else k)
    return out


class TreeShaper:
    """Shapes each cycle's tree from the drafter's candidates and learns, from what the target took, how they
    pass (a `CalibratedAcceptance`). One per draft source; `budget`: the most rows a tree may have, the anchor
    included (the controller chooses each cycle's size up to it; a fixed block uses all of it). `read` turns
    the drafter's pass into its candidates (`drafter_candidates`: by kind); by default DFlash logits (D, V).

    After each verified tree it also says what trees of every smaller size would have committed (`TreeOutcome`),
    which the controller learns from: `take_outcome()` once the loop has committed the cycle's tokens."""

    def __init__(self, n_slots: int, budget: int, *, k: int = 8, drafter: "Drafter | None" = None) -> None:
        if budget < 2:
            raise ValueError(f"a tree needs the anchor and at least one draft (budget >= 2), got {budget}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.budget = budget
        self.k = k
        self._read = (lambda out, anchor: SlotCandidates.from_logits(out, k)) if drafter is None else (
            drafter_candidates(drafter, k))
        self.acceptance = CalibratedAcceptance(n_slots)
        # (n_past, the candidates offered by (depth, token), tree) of the last tree shaped
        self._shaped: tuple[int, dict[tuple[int, int], _Offered], DraftTree] | None = None
        self._accepted: tuple[int, list[int]] | None = None  # (where its bonus is committed, the accepted path's rows)
        self._outcome: TreeOutcome | None = None

    def shape(self, anchor: int, n_past: int, out: np.ndarray, rows: int | None = None,
              costs: "TreePrices | None" = None) -> DraftTree:
        """The tree of `rows` rows (default: the budget) after `anchor` at n_past from the drafter's pass `out`
        (Drafter.draft's output): its likeliest nodes under the calibrated acceptance.

        costs: cut it to the rows that pay best this cycle (`best_rows`: this cycle's candidates' chances
        over the measured verify costs), where the controller chose a tree sized per cycle."""
        return self.shape_from(anchor, n_past, self._read(out, anchor), rows, costs)

    def shape_candidates(self, anchor: int, n_past: int, ids: np.ndarray, q: np.ndarray,
                         rows: int | None = None, costs: "TreePrices | None" = None) -> DraftTree:
        """As `shape`, from each slot's candidates ids (D, k), best first, and their drafter probabilities q."""
        return self.shape_from(anchor, n_past, SlotCandidates(ids, q), rows, costs)

    def shape_from(self, anchor: int, n_past: int, cands: Candidates, rows: int | None = None,
                   costs: "TreePrices | None" = None) -> DraftTree:
        """As `shape`, from the candidates themselves."""
        rows = self.budget if rows is None else rows
        if not 2 <= rows <= self.budget:
            raise ValueError(f"rows must be in [2, {self.budget}] (the budget), got {rows}")
        self.observe(n_past, [anchor])  # the anchor is the last tree's bonus
        offered: dict[tuple[int, int], _Offered] = {}

        def children(path: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
            depth, token = len(path) - 1, path[-1]  # what a drafter's candidates depend on
            got = offered.get((depth, token))
            if got is None:
                ids, q = cands.after(depth, token)
                got = offered[(depth, token)] = _Offered(ids, q, self.acceptance.accept_at(depth + 1, q))
            return got.ids, got.accept

        tree = grow_tree(anchor, children, cands.n_slots, rows)
        if costs is not None:
            cut = best_rows(tree, costs.tree_verify_s, costs.draft_s(cands.n_slots + 1))
            if cut < len(tree):
                tree = grow_tree(anchor, children, cands.n_slots, cut)  # its first `cut` nodes, as best first adds them
        self._shaped, self._accepted, self._outcome = (n_past, offered, tree), None, None
        return tree

    def observe(self, start: int, tokens: Sequence[int]) -> None:
        """Tokens committed at start.. (the loop's Commit). The commit at the tree's anchor holds the accepted
        drafts (the path the target took, hence the outcome); the next one starts with the bonus, the target's
        token at the first slot it rejected, which the calibration needs: at each slot of the path and the one
        after, which of the candidates its parent offered the target took."""
        if self._accepted is not None and start == self._accepted[0]:
            _, offered, tree = self._shaped
            path = self._accepted[1]
            keys = [(tree.depths[r], tree.tokens[r]) for r in path]
            rows = [offered[key] for key in keys if key in offered]  # the last is absent at the deepest slot
            if rows:
                continuation = [tree.tokens[r] for r in path[1:]] + [tokens[0]]
                self.acceptance.observe(np.stack([o.q for o in rows]),
                                        target_ranks(np.stack([o.ids for o in rows]), continuation))
            self._shaped = self._accepted = None
        elif self._shaped is not None and start == self._shaped[0] and (path := follow(self._shaped[2], tokens)):
            self._accepted = (start + len(tokens), path)
            self._outcome = tree_outcome(self._shaped[2], path)
        else:  # not the tree's commit (a generation cut between its draft and its verify): forget it
            self._shaped = self._accepted = self._outcome = None

    def take_outcome(self) -> "TreeOutcome | None":
        """What the last shaped tree's cycle committed, and what smaller trees and its chain would have; once."""
        out, self._outcome = self._outcome, None
        return out


@dataclass(frozen=True)
class _Offered:
    """The candidates a node offered its children: ids and the drafter's q, best first; accept as calibrated."""

    ids: np.ndarray
    q: np.ndarray
    accept: np.ndarray


def follow(tree: DraftTree, tokens: Sequence[int]) -> list[int] | None:
    """The rows of the path whose tokens (the anchor's first) are `tokens`, or None where they are no path of
    the tree (siblings hold distinct tokens, so there is one at most)."""
    if not tokens or tokens[0] != tree.tokens[0]:
        return None
    path = [0]
    for tok in tokens[1:]:
        row = next((c for c in tree.children(path[-1]) if tree.tokens[c] == tok), None)
        if row is None:
            return None
        path.append(row)
    return path


@dataclass(frozen=True)
class TreeOutcome:
    """A verified tree's cycle, and the counterfactuals the controller learns from.

    committed[m - 1]: tokens the cycle would have committed (the bonus included) had the tree been only its
    m likeliest rows, m = 1..rows (a best-first tree of m rows is exactly those). Exact under greedy
    verification: the target's token at every row of the accepted path is known, and a smaller tree stops
    where the path leaves it. chain_drafts / chain_accepted: the same cycle as a linear block of the tree's
    first chain (the top-1 candidates), which the linear acceptance profile learns from.
    """

    rows: int
    is_path: bool
    committed: tuple[int, ...]
    chain_drafts: int
    chain_accepted: int


def tree_outcome(tree: DraftTree, path: Sequence[int]) -> TreeOutcome:
    """The outcome of a tree whose accepted rows are `path` (anchor first)."""
    order = sorted(range(1, len(tree)), key=lambda r: (-tree.probs[r], tree.depths[r], r))
    needed = {row: i + 2 for i, row in enumerate(order)}  # rows a best-first tree needs to hold this row
    committed = [1] * len(tree)
    need = 1
    for k, row in enumerate(path[1:], start=1):  # the first k path rows are all in the trees of >= need rows
        need = max(need, needed[row])
        for m in range(need, len(tree) + 1):
            committed[m - 1] = k + 1
    chain = 0
    while chain + 1 < len(path) and path[chain + 1] == chain + 1 <= tree.first_leaf:
        chain += 1
    return TreeOutcome(len(tree), tree.is_path, tuple(committed), tree.depths[tree.first_leaf], chain)


def best_rows(tree: DraftTree, verify_s: Callable[[int], float], draft_s: float = 0.0) -> int:
    """The number of rows (2..len(tree)) whose likeliest nodes commit the most tokens per second: best first,
    the tree of n rows holds the n - 1 likeliest nodes of this one."""
    probs = sorted(tree.probs[1:], reverse=True)
    best, best_rate, expected = 2, 0.0, 1.0
    for n, p in enumerate(probs, start=2):
        expected += p
        rate = expected / (draft_s + verify_s(n))
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def share_prefix(target: "Target", tree: DraftTree) -> None:
    """Before a tree's verify: every path's sequence holds the committed prefix of sequence 0."""
    for s in range(1, len(tree.leaves)):
        target.copy_sequence(0, s)


def keep_path(target: "Target", tree: DraftTree, n_past: int, path: Sequence[int]) -> None:
    """After a tree's verify: sequence 0 holds the prefix and the accepted path's rows, and nothing else is kept.

    Its cells must also stay in position order. Flash attention sums over the cells in their order (in f16 on
    the CPU), so a cell freed between two kept ones and refilled by a later token would change what every later
    token computes (logits moved by up to ~1 in a measurement) and plain decoding would no longer be reproduced.
    A path along the first chain (rows 0..a) keeps its cells; any other is saved, every tree cell freed, and
    the path written back from the anchor's cell on, in order (llama_state_seq: its cells' K/V bytes, unchanged).
    """
    leaf = tree.seq_ranges[path[-1]][0]  # the sequence of a leaf below the accepted rows
    if path[-1] == len(path) - 1:  # rows 0..a: leaf 0's chain, which sequence 0 already is
        target.remove(0, n_past + len(path))
        for s in range(1, len(tree.leaves)):
            target.remove(s, 0)
        return
    target.remove(leaf, n_past + len(path))
    target.remove(leaf, 0, n_past)  # the sequence is now the path's rows alone
    saved = state_seq_get(target.ctx, leaf)
    target.remove(0, n_past)
    for s in range(1, len(tree.leaves)):
        target.remove(s, 0)  # every tree cell is free; the lowest of them, the anchor's, is where the search starts
    state_seq_set(target.ctx, saved, leaf)
    target.copy_sequence(leaf, 0)
    target.remove(leaf, 0)


def branching_refused(target: "Target", memory: "TargetMemory") -> str | None:
    """Why this target's memory cannot verify a tree's branches however it is opened, or None: a recurrent state
    (a hybrid target's) is one per sequence, advanced token by token, and a tree's branches would each need
    their own copy of it, forked at every node that branches; its memory keeps no such copies, so its cycles
    verify linear blocks (what dflash-doctor and a Session's tree_disabled_reason say)."""
    if not memory.keeps_trees:
        return (f"{target.architecture}: its recurrent state would need a copy per branch, which is not kept; "
                "linear blocks instead")
    return None


def tree_unusable(target: "Target", memory: "TargetMemory") -> str | None:
    """Why this target's cycles cannot verify trees (they verify linear blocks then), or None. Any drafter kind,
    and lookup, shape trees."""
    if (refused := branching_refused(target, memory)) is not None:
        return refused
    if not target.kv_unified:
        return "the target's KV cache is not unified: a node shared by several paths needs one"
    return None

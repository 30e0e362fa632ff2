"""The decode loop: prefill, then offer -> choose -> propose -> verify -> accept -> keep -> commit, one Step per cycle.

Modelled on z-lab's `dflash_generate`: a block is [last committed token, d1..dk]; after verification the
target memory keeps the committed rows, every draft source observes them, and the target's bonus token
starts the next block. Plain decoding runs through the same loop, as cycles that draft nothing. The loop
holds no C calls: the target decodes, the memory rolls back, the sources draft.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np

from .acceptance import accept_greedy, accept_sampled
from .config import GenerationConfig
from .constraints import Constraint
from .controller import Choice, CycleTiming, PlainPolicy, Policy
from .memory import TargetMemory
from .sampling import SamplingParams, adjusted_logits, greedy_tokens, probabilities, sample_token, token_logprobs
from .sources import Candidate, Commit, DraftSource, Offer
from .steps import Step, StepKind, TokenLogprob, TokenSource
from .target import Target
from .tree import keep_path, share_prefix, walk_greedy, walk_sampled


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share. It iterates, never indexes, so a reader on another thread
    gets a (stale) count, never an IndexError, while the owner of `a` truncates it."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class TokensView(Sequence[int]):
    """The committed tokens, read-only and never copied: what readers outside the loop are given (a server's
    slot routes prompts by it). It follows its owner: read it again rather than keep what it said."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self._tokens = tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def __getitem__(self, i):  # a slice comes back as a new list: the caller's own copy of that part
        return self._tokens[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._tokens)

    def __repr__(self) -> str:
        return f"TokensView({len(self._tokens)} tokens)"


@dataclass
class CacheState:
    """The tokens the target memory holds for sequence 0: the one copy of the committed sequence.

    The loop commits to it and truncates it, and every reader shares this list instead of keeping its own:
    the draft sources through `Commit.sequence` (lookup's n-gram index reads it), the prompt cache when it
    stores, a server's slot through `view`. `reused`: how many tokens of the last prompt it held.
    """

    tokens: list[int] = field(default_factory=list)
    reused: int = 0

    @property
    def view(self) -> TokensView:
        return TokensView(self.tokens)

    def common_prefix(self, prompt: Sequence[int]) -> int:
        """Cached tokens shared with the prompt, leaving the last prompt token to decode for its logits."""
        return min(shared_prefix(self.tokens, prompt), len(prompt) - 1)

    def truncate(self, n: int, sources: Iterable[DraftSource] = ()) -> None:
        """Drop positions >= n, the sources' first: a source may read the tokens it forgets (lookup does)."""
        for s in sources:
            s.truncate(n)
        del self.tokens[n:]

    def commit(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)

    def invalidate(self, sources: Iterable[DraftSource] = ()) -> None:
        """The target's memory is in an unknown state: nothing cached may be trusted."""
        self.truncate(0, sources)
        self.reused = 0


@dataclass(frozen=True)
class PrefixHook:
    """Call `save` when the prefill has committed exactly the prompt's first `n` tokens, with every source
    brought up to date there: the prompt cache keeps that state for a resent prompt to resume from."""

    n: int
    save: Callable[[], None]


class StopCheck(Protocol):
    """Where a reply ends at a stop string, as the loop is handed it (the chat floor's ReplyReader is one): fed
    the reply's text as it grows, it says how many of its characters are `settled` (no stop string can take
    them back) and which stop string ended the reply, once one has. finish(): the reply has ended, settle all."""

    settled: int
    stop_sequence: str | None

    def feed(self, text: str) -> object: ...

    def finish(self) -> object: ...


class TextStream:
    """Incremental detokenisation, each character keeping the provenance of the token that produced it (its
    source's name), given out as the stop check settles it (all at once without one).

    Text comes out as (piece, source) pairs: held-back text keeps the source of the token that produced
    it, not of the token that released it.
    """

    def __init__(self, target: Target, check: StopCheck | None) -> None:
        self._token_bytes = target.vocab.token_bytes
        self._check = check
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held: list[tuple[str, str]] = []  # fed to the check, not settled yet
        self._given = 0  # characters given out

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return None if self._check is None else self._check.stop_sequence

    def feed(self, token: int, source: str) -> tuple[list[tuple[str, str]], bool]:
        """(text now safe to emit, whether a stop string completed) after one more token."""
        piece = self._decoder.decode(self._token_bytes(token))
        if self._check is None:  # nothing is ever held back
            return ([(piece, source)] if piece else []), False
        if piece:
            self._held.append((piece, source))
            self._check.feed(piece)
        stopped = self._check.stop_sequence is not None
        out = self._settled()
        if stopped:
            self._held = []
        return out, stopped

    def flush(self, source: str) -> list[tuple[str, str]]:
        """Everything held, and the decoder's tail (an incomplete character) as `source`'s."""
        tail = self._decoder.decode(b"", final=True)
        if self._check is None:
            return [(tail, source)]
        if tail:
            self._held.append((tail, source))
            self._check.feed(tail)
        self._check.finish()
        out, self._held = self._settled(), []
        return out

    def _settled(self) -> list[tuple[str, str]]:
        """The held characters the check has settled since the last call, each with its source."""
        n = self._check.settled - self._given
        if n == 0:
            return []
        self._given += n
        out: list[tuple[str, str]] = []
        while n > 0 and self._held:
            text, src = self._held[0]
            if len(text) <= n:
                out.append(self._held.pop(0))
                n -= len(text)
            else:
                out.append((text[:n], src))
                self._held[0] = (text[n:], src)
                n = 0
        return out


def decode_steps(
    target: Target,
    prompt: Sequence[int],
    config: GenerationConfig,
    cache: CacheState,
    *,
    memory: TargetMemory,
    sources: Sequence[DraftSource] = (),
    policy: Policy | None = None,
    constraint: Constraint | None = None,
    prefix_hook: PrefixHook | None = None,
    stop_check: StopCheck | None = None,
) -> Iterator[Step]:
    """Generate from `prompt`, reusing the cached prefix; yields one Step per cycle, the last with finish_reason.

    The first Step (kind PREFILL) holds the token sampled from the prompt, its verify_s the prefill time.
    Sources are fed only when config.speculative; all of them are truncated with the target, so none holds
    state the target has dropped. `cache` is kept true after every yield: a caller may stop at any point.
    A constraint (a fresh matcher for this generation) masks every row the target's tokens are chosen from.
    A prefix hook inside the uncached part of the prompt ends a prefill chunk at its position and is called there.
    The loop judges no text itself: a fresh `stop_check` for this reply (the chat floor's ReplyReader over
    config.stop) says where a stop string ends it and what text waits until it is known not to begin one.
    Penalties judge verify row i with the reply so far and the drafts before row i, which is the reply that
    row is read after (a row after a rejected draft is never read): speculation changes no token's law.
    The committed tokens are held once, in `cache`: the position a cycle decodes at is their length, the
    reply the penalties count is their part after the prompt, and the sources read them from each Commit.
    """
    n_ctx = target.n_ctx_seq
    if not 0 < len(prompt) <= n_ctx:
        raise ValueError(f"prompt of {len(prompt)} tokens does not fit: need 1..{n_ctx} (the context size)")
    active = list(sources) if config.speculative and memory.can_rollback else []
    if not active:
        policy = PlainPolicy()
    elif policy is None:
        raise ValueError("speculative decoding needs a Policy")
    by_name = {s.name: s for s in active}
    params = config.sampling
    params.check_vocab(target.n_vocab)
    rng = params.rng()
    if config.stop and stop_check is None:
        raise ValueError("config.stop needs a stop_check to read the reply (chat.reply.ReplyReader(stops=config.stop))")
    text = TextStream(target, stop_check)
    max_tokens = n_ctx if config.max_tokens is None else config.max_tokens  # None: until the context is full
    features = any(s.needs_features for s in active)
    committed = cache.tokens  # read, never copied: the loop changes it only through `cache`
    n_prompt = len(prompt)
    n_logprobs = config.logprobs
    # a tree's rows are judged one path each: no grammar (its matcher follows one path), no penalties (their
    # windows are one path's); else its first path is verified, as a linear block
    trees = constraint is None and not params.penalizes and memory.keeps_trees and target.kv_unified

    def choose_from(raw: np.ndarray, block: Sequence[int]) -> np.ndarray:
        """The verify rows to choose from: masked by the constraint, then biased and penalised per row.
        block: the uncommitted tokens the rows are read after, [last, drafts...] (none at the prefill)."""
        rows = raw if constraint is None else constraint.mask_block(raw, block[1:])
        if not params.adjusts:
            return rows
        return adjusted_logits(rows, params, _windows(params, committed, n_prompt, block, n_ctx, rows.shape[0]))

    def logprobs_of(raw: np.ndarray, chosen: Sequence[int]) -> list[TokenLogprob] | None:
        if n_logprobs is None:
            return None
        return [TokenLogprob(t, lp, top) for t, (lp, top) in zip(chosen, token_logprobs(raw, chosen, n_logprobs))]

    keep = min([cache.common_prefix(prompt)] + [s.cached() for s in active])
    keep = memory.truncate(keep)
    cache.truncate(keep, sources)
    cache.reused = keep

    def commit(start: int, tokens: Sequence[int], at: Sequence[int] | None = None) -> None:
        """at: the last decode's rows the tokens were (a tree's path); None: its first len(tokens) rows."""
        cache.commit(tokens)
        if active:
            rows = len(tokens)
            read = (lambda into: target.append_features(into, rows)) if at is None else (
                lambda into: target.append_feature_rows(into, at))
            c = Commit(start, tokens, read if features else None, sequence=committed)
            for s in active:
                s.observe(c)

    # prefill the uncached prompt suffix in n_batch chunks; sources see every chunk. The last prompt token is
    # decoded alone, as it is after a restore or a reuse of the live context (they keep len(prompt) - 1 at
    # most): batched with the rest, its logits differ (flash attention tiles a batch), and a prompt's greedy
    # reply would depend on whether it was cached
    t0 = time.perf_counter()
    pos = keep
    hook = prefix_hook if prefix_hook is not None and keep < prefix_hook.n < len(prompt) else None
    cuts = sorted({len(prompt) - 1, len(prompt)} | ({hook.n} if hook is not None else set()))
    while pos < len(prompt):
        end = min(pos + target.n_batch, next(c for c in cuts if c > pos))
        target.decode(prompt[pos:end], pos, logits="last" if end == len(prompt) else False)
        commit(pos, prompt[pos:end])
        pos = end
        if hook is not None and pos == hook.n:
            for s in active:
                s.finish()
            hook.save()
    logits = target.output_logits()[-1:]
    last = _pick(choose_from(logits, ()), params, rng)
    if constraint is not None:
        constraint.commit([last])
    for s in active:
        s.finish()
    prefill_s = time.perf_counter() - t0

    out = _commit([last], [TokenSource.PREFILL], text, target, max_tokens, 0, logprobs_of(logits, [last]))
    n_generated = 1
    done = out.finish_reason
    yield Step(kind=StepKind.PREFILL, verify_s=prefill_s, block_size=1, reason="prefill", **out.fields())

    while not done:
        t_cycle = time.perf_counter()
        n_past = len(committed)  # the position of `last`
        if n_past >= n_ctx:
            tail = _spans(text.flush(TokenSource.PLAIN))
            yield Step(kind=StepKind.CONTEXT_FULL, tokens=[], text="".join(t for t, _ in tail), spans=tail,
                       reason="context full", finish_reason="length")
            return
        # the block [last, drafts] must fit the context and one batch, and commit no more than max_tokens allows
        room = max(0, min(n_ctx - n_past - 1, target.n_batch - 1, max_tokens - n_generated - 1))
        choice = policy.choose(_offers(active, last, n_past, room))
        if choice.n_draft > room:
            choice = _shorten(choice, room)
        n_draft = choice.n_draft

        candidate: Candidate | None = None
        t_draft = time.perf_counter()
        if n_draft:
            candidate = by_name[choice.source].propose(last, n_past, n_draft, params, rng)
        tree = None if candidate is None else candidate.tree
        if tree is not None and (not trees or tree.is_path or len(tree.leaves) > target.n_seq_max):
            tree = None  # verified as its first path, the linear block
        if candidate is not None and tree is None:
            n_verify = policy.verify_length(candidate)
            if n_verify < n_draft:  # the proposal's confidences say the rest would fail: verify fewer
                choice = _shorten(choice, n_verify, f"; confidence cut to {n_verify}")
                n_draft = n_verify
                candidate = candidate.head(n_draft) if n_draft else None
        if constraint is not None and candidate is not None and params.greedy:
            # a draft the grammar forbids can never be the masked argmax: verify only the drafts before it
            # (sampling keeps them: its rejection of a forbidden draft is what keeps the residual exact)
            n_ok = constraint.valid_prefix(candidate.tokens)
            if n_ok < n_draft:
                choice = _shorten(choice, n_ok, f"; grammar cut to {n_ok}")
                n_draft = n_ok
                candidate = candidate.head(n_draft) if n_draft else None
        block = [last] + ([] if candidate is None else candidate.tokens.tolist())
        path: list[int] | None = None  # a tree's accepted rows, anchor first
        t_save = time.perf_counter()
        if tree is None:
            memory.before_verify(n_past, len(block))
            t_verify = time.perf_counter()
            target.decode(block, n_past, logits=True)
            raw = target.output_logits()
            n_accepted, bonus = _verify(choose_from(raw, block), candidate, params, rng)
        else:
            share_prefix(target, tree)
            t_verify = time.perf_counter()
            target.decode_tree(tree.tokens, [n_past + d for d in tree.depths], tree.seq_ranges)
            raw = target.output_logits()
            if params.greedy:
                argmax = greedy_tokens(choose_from(raw, ()))
                path, bonus = walk_greedy(tree, lambda row: int(argmax[row]))
            else:
                path, bonus = walk_sampled(tree, probabilities(choose_from(raw, ()), params), rng)
            block = [tree.tokens[row] for row in path]
            n_accepted = len(path) - 1
        chosen = block[1 : n_accepted + 1] + [bonus]
        chosen_logprobs = logprobs_of(raw if path is None else raw[path], chosen)
        t_keep = time.perf_counter()
        if tree is None:
            memory.keep(n_past, block, n_accepted + 1)
        else:
            keep_path(target, tree, n_past, path)
        t_done = time.perf_counter()

        commit(n_past, block[: n_accepted + 1], path)
        if constraint is not None:
            constraint.commit(chosen)
        # a rollback costs what the memory saved before the verify and what keeping the accepted rows took
        timing = CycleTiming(len(block) if tree is None else len(tree), t_save - t_draft, t_keep - t_verify,
                             (t_verify - t_save) + (t_done - t_keep))
        policy.observe(choice, n_accepted, timing)

        drafted = by_name[choice.source].provenance if n_draft else None
        provenance = [drafted] * n_accepted + [TokenSource.BONUS if n_draft else TokenSource.PLAIN]
        out = _commit(chosen, provenance, text, target, max_tokens, n_generated, chosen_logprobs)
        n_generated += n_accepted + 1
        done = out.finish_reason
        last = bonus
        if done:
            for s in active:
                s.finish()  # so that a follow-up turn reuses the whole prefix everywhere
            memory.end_of_turn(len(committed))
        yield Step(
            kind=choice.kind if n_draft else StepKind.PLAIN,
            source=choice.source if n_draft else None,
            n_drafted=n_draft if tree is None else tree.max_depth,
            n_accepted=n_accepted,
            bonus_token=bonus,
            block_size=timing.block_tokens,
            tree_nodes=0 if tree is None else len(tree),
            tree_branch=0 if tree is None else tree.seq_ranges[path[-1]][0],
            reason=choice.reason,
            draft_s=timing.draft_s,
            verify_s=timing.verify_s,
            rollback_s=timing.rollback_s,
            cycle_s=time.perf_counter() - t_cycle,
            confidences=() if candidate is None or candidate.confidences is None else tuple(map(float, candidate.confidences)),
            **out.fields(),
        )


def _shorten(choice: Choice, n_draft: int, note: str = "") -> Choice:
    """The same choice with fewer drafts (none: a plain step)."""
    if n_draft == 0:
        return Choice(None, 0, StepKind.PLAIN, choice.reason + note)
    return Choice(choice.source, n_draft, choice.kind, choice.reason + note)


def _offers(sources: Sequence[DraftSource], last: int, n_past: int, room: int) -> list[Offer]:
    """What each source offers now, within the room this cycle has (sources with nothing to propose left out)."""
    if room == 0:
        return []
    offers = []
    for s in sources:
        n = min(s.available(last, n_past), room)
        if n > 0:
            offers.append(s.offer(last, n_past, n))
    return offers


def _windows(
    params: SamplingParams, committed: Sequence[int], start: int, block: Sequence[int], n_ctx: int, rows: int
) -> list[list[int]]:
    """What the penalties count at each verify row: the reply (committed[start:], then block[0], chosen but
    not yet committed) and, for row i, the drafts before it, block[1 : i + 1]."""
    if not params.penalizes:
        return []
    n = n_ctx if params.repeat_last_n < 0 else params.repeat_last_n
    seq = [*committed[max(start, len(committed) - n):], *block]
    base = len(seq) - len(block[1:])
    return [seq[max(0, base + i - n) : base + i] for i in range(rows)]


def _pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from one row of logits: argmax, or a sample from the params' distribution."""
    if params.greedy:
        return int(greedy_tokens(logits[:1])[0])
    return sample_token(probabilities(logits[:1], params)[0], rng)


def _verify(logits: np.ndarray, candidate: Candidate | None, params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
    """(n_accepted, bonus) for a verified block; logits (k+1, V) are the target's rows for [last, d1..dk]."""
    if candidate is None:
        return 0, _pick(logits, params, rng)
    if params.greedy:
        return accept_greedy(candidate.tokens, greedy_tokens(logits))
    q, q_ids = candidate.proposal()
    return accept_sampled(candidate.tokens, q, probabilities(logits, params), rng, draft_indices=q_ids)


@dataclass(frozen=True)
class _Committed:
    tokens: list[int]
    text: str
    provenance: tuple[str, ...]
    spans: tuple[tuple[str, str], ...]
    finish_reason: str | None
    stop_sequence: str | None
    logprobs: tuple[TokenLogprob, ...]

    def fields(self) -> dict:
        return {"tokens": self.tokens, "text": self.text, "provenance": self.provenance, "spans": self.spans,
                "finish_reason": self.finish_reason, "stop_sequence": self.stop_sequence, "logprobs": self.logprobs}


def _commit(
    new: list[int], provenance: Sequence[str], text: TextStream, target: Target, max_tokens: int,
    n_generated: int, logprobs: Sequence[TokenLogprob] | None = None,
) -> _Committed:
    """Apply the stop rules to freshly committed tokens: EOG, stop strings, max_tokens, in token order."""
    tokens: list[int] = []
    pieces: list[tuple[str, str]] = []
    finish = None
    for i, (tok, src) in enumerate(zip(new, provenance)):
        if target.vocab.is_eog(tok):
            pieces += text.flush(src)
            finish = "stop"
            break
        tokens.append(tok)
        released, stopped = text.feed(tok, src)
        pieces += released
        if stopped:
            finish = "stop"
            break
        if n_generated + i + 1 >= max_tokens:
            pieces += text.flush(src)
            finish = "length"
            break
    spans = _spans(pieces)
    return _Committed(
        tokens, "".join(t for t, _ in spans), tuple(provenance[: len(tokens)]), spans, finish, text.stopped_by,
        tuple(logprobs[: len(tokens)]) if logprobs else (),
    )


def _spans(pieces: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """Adjacent pieces of the same provenance merged, empty ones dropped."""
    out: list[tuple[str, str]] = []
    for piece, src in pieces:
        if not piece:
            continue
        if out and out[-1][1] == src:
            out[-1] = (out[-1][0] + piece, src)
        else:
            out.append((piece, src))
    return tuple(out)

"""Committed tokens are held once: the Session's CacheState holds them and every reader shares that list.

Lookup's n-gram index reads it (its tables follow each commit and truncation), every source is handed it
with each commit, a prompt-cache restore refills it in place, and a server's slot routes by it. No reader
keeps a copy that could fall out of step with what the target holds.
"""

from __future__ import annotations

import pytest

from dflash_gguf import Session
from dflash_gguf.decoding import shared_prefix
from dflash_gguf.lookup import NgramIndex
from dflash_gguf.prompt_cache import PromptCache
from dflash_gguf.server.config import ServerConfig
from dflash_gguf.server.engine import Engine
from dflash_gguf.server.metrics import Metrics
from dflash_gguf.server.schemas import Job
from dflash_gguf.server.slots import SlotPool
from dflash_gguf.sources import Commit, DraftSource

COPY = (
    "Repeat this paragraph exactly.\n\nDr. No is the sixth novel by the English author Ian Fleming to feature his "
    "British Secret Service agent James Bond. Written at Fleming's Goldeneye estate in Jamaica, it was first "
    "published in the United Kingdom by Jonathan Cape in 1958."
)
N = 24  # reply tokens: the copy is drafted by lookup within them


class Witness(DraftSource):
    """A source that never drafts and checks what the loop hands it: each commit's sequence is one list that
    already ends with the commit's tokens, and a truncation comes while that list still holds what it drops."""

    name = "witness"
    max_draft = 1

    def __init__(self) -> None:
        self.sequences: set[int] = set()  # ids of the sequences commits carried
        self.seq: list[int] | None = None
        self.n = 0
        self.problems: list[str] = []

    def cached(self) -> int:
        return self.n

    def truncate(self, n: int) -> None:
        if self.seq is not None and n < self.n and len(self.seq) < self.n:
            self.problems.append(f"truncated to {n} after the tokens were dropped ({len(self.seq)} < {self.n})")
        self.n = min(self.n, n)

    def available(self, last: int, n_past: int) -> int:
        if n_past != len(self.seq):
            self.problems.append(f"the loop is at {n_past}, the committed tokens number {len(self.seq)}")
        return 0

    def propose(self, last, n_past, n_draft, params, rng):
        raise AssertionError("never offered")

    def observe(self, commit: Commit) -> None:
        seq = commit.sequence
        self.sequences.add(id(seq))
        self.seq = seq
        if list(seq[commit.start :]) != list(commit.tokens):
            self.problems.append(f"commit at {commit.start}: the sequence does not end with its tokens")
        self.n = commit.start + len(commit.tokens)


@pytest.fixture(scope="module")
def witnessed(embedded_target):
    """A drafter-free Session (lookup drafts) with a witness source beside lookup."""
    witness = Witness()
    with Session(embedded_target, n_ctx=1024, n_threads=1, sources=[witness]) as s:
        yield s, witness


def chat_tokens(session: Session, text: str) -> list[int]:
    prompt, _ = session.render_chat([{"role": "user", "content": text}])
    return session.tokenize(prompt, add_special=False)


def reply_of(session: Session, tokens: list[int], **gen) -> list[int]:
    return [t for step in session.stream_tokens(tokens, block_size=8, **gen) for t in step.tokens]


def assert_held_once(session: Session) -> None:
    """Lookup's index reads the Session's list, covers all of it, and holds no list of tokens of its own."""
    committed = session._cache.tokens
    index = session._lookup.index
    assert index.tokens is committed and len(index) == len(committed)
    fresh = NgramIndex(list(committed))
    fresh.extend_to(len(committed))
    assert index._tables == fresh._tables  # exactly the tables of the tokens held, nothing stale
    for owner in (index, session._lookup):
        copies = [k for k, v in vars(owner).items()
                  if isinstance(v, (list, tuple)) and v is not committed and len(v) >= len(committed) > 0]
        assert not copies, f"{type(owner).__name__} keeps {copies}"


def test_commits_and_truncations_reach_every_reader_through_one_list(witnessed):
    s, witness = witnessed
    s.reset()
    committed = s._cache.tokens
    view = s.committed_tokens
    a = chat_tokens(s, COPY)
    reply = reply_of(s, a, max_tokens=N)
    stats = s.last_stats
    assert stats.per_source["lookup"].n_accepted > 0  # lookup drafted the copy from the shared tokens
    assert len(reply) == N  # cut by max_tokens: its last token was chosen, never decoded
    assert list(view) == a + reply[:-1]
    assert_held_once(s)

    before = list(view)
    b = chat_tokens(s, COPY.split("\n\n")[0] + " Then count to ten.")  # shares the first sentence only
    reply_b = reply_of(s, b, max_tokens=N // 2)
    assert 0 < s.last_stats.n_cached_tokens == min(shared_prefix(before, b), len(b) - 1) < len(a) // 2
    assert s._cache.tokens is committed  # truncated and extended in place
    n = len(b) + len(reply_b) - 1  # (an end-of-generation token ends the reply undecoded: one more then)
    assert len(view) >= n and list(view[:n]) == b + reply_b[:-1]  # the view read before follows
    assert_held_once(s)
    assert witness.sequences == {id(committed)} and not witness.problems


def test_a_restored_state_refills_the_one_list(embedded_target):
    """A prompt-cache hit replaces what the list holds (the stored prompt and reply, then cut back to the
    prompt by the loop, the index first); lookup indexes it where it is and drafts from it."""
    with Session(embedded_target, n_ctx=1024, n_threads=1, prompt_cache=PromptCache(ram_bytes=1 << 28)) as s:
        prompt = chat_tokens(s, COPY)
        reply_of(s, prompt, max_tokens=N)
        committed, index = s._cache.tokens, s._lookup.index
        s.reset()
        assert len(s.committed_tokens) == 0 and len(index) == 0
        reply_of(s, prompt, max_tokens=N)
        stats = s.last_stats
        assert stats.prompt_cache.tier == "ram" and stats.n_cached_tokens == len(prompt) - 1
        assert stats.per_source["lookup"].n_accepted > 0
        assert s._cache.tokens is committed and s._lookup.index is index
        assert_held_once(s)


def test_a_slot_routes_by_what_its_session_holds(witnessed):
    """The slot reads its Session's tokens, so it never claims a conversation its Session has dropped."""
    s, _ = witnessed
    slot = SlotPool([s], max_queue=1).slots[0]
    s.reset()
    prompt = chat_tokens(s, "Name three colours.")
    assert slot.shared_prefix(prompt) == 0
    reply = reply_of(s, prompt, max_tokens=8)
    assert len(slot.cached) == len(s._cache.tokens) and not isinstance(slot.cached, list)
    assert slot.shared_prefix(prompt + reply + [0]) == len(prompt) + len(reply) - 1
    s.reset()
    assert slot.shared_prefix(prompt) == 0  # a copy kept at the release would still claim it


def test_the_server_tokenizes_a_prompt_once(witnessed, monkeypatch):
    """Engine.prepare renders and tokenizes; the generation takes those tokens as they are (stream_tokens)."""
    s, _ = witnessed
    s.reset()
    calls: list[str] = []
    tokenize = s.target.vocab.tokenize

    def counted(text, **kw):
        calls.append(text)
        return tokenize(text, **kw)

    monkeypatch.setattr(s.target.vocab, "tokenize", counted)
    engine = Engine([s], ServerConfig(), Metrics())
    job = Job(messages=[{"role": "user", "content": "Name three colours."}], prompt=None,
              gen={"max_tokens": 4, "block_size": 4})
    prepared = engine.prepare(job)
    steps = list(prepared.start(s))
    assert len(calls) == 1 and steps[-1].finish_reason is not None
    assert list(s.committed_tokens[: len(prepared.tokens)]) == prepared.tokens


def test_penalties_count_the_reply_as_the_committed_tokens_hold_it(witnessed):
    """The penalties read the reply from the committed tokens (no copy of it is kept): with drafting and a
    repeat penalty the reply equals plain decoding under the same penalty."""
    s, _ = witnessed
    prompt = chat_tokens(s, COPY)
    s.reset()
    plain = [t for st in s.stream_tokens(prompt, max_tokens=N, speculative=False, repeat_penalty=1.3) for t in st.tokens]
    s.reset()
    drafted = reply_of(s, prompt, max_tokens=N, repeat_penalty=1.3)
    assert s.last_stats.per_source["lookup"].n_drafted > 0
    assert drafted == plain

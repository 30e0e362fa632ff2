"""Issue 34's wall for draft sources: a new one is one module and one line in speculation.SOURCES. Written
here to a file of its own, a bigram source is made by every Session (and each fork), drafts under the policy
like the shipped ones, keeps greedy output exactly the target's, and is closed with its Session. The tokens
it gets accepted carry its name as their provenance, which the stats count and the chat colours and keys
in a colour of its own, with no other edit."""

from __future__ import annotations

import importlib.util

import pytest

from dflash_gguf import speculation
from dflash_gguf.session import Session
from dflash_gguf.steps import TokenSource
from dflash_gguf.tui.provenance import Palette, Provenance, display, pieces_of
from dflash_gguf.tui.widgets import LEGEND, legend
from dflash_gguf.tui.worker import SessionInfo

BIGRAM_SOURCE = '''
"""Proposes, after a token, what followed it the last time it was committed (an n-gram lookup of one)."""

import numpy as np

from dflash_gguf.sources import Candidate, DraftSource, Offer


class BigramSource(DraftSource):
    name = "bigram"

    def __init__(self, max_draft):
        self.max_draft = max_draft
        self.after = {}  # token -> the token that followed it last
        self.sequence = []
        self.closed = False

    def cached(self):
        return len(self.sequence)

    def truncate(self, n):
        if n < len(self.sequence):
            del self.sequence[n:]
            self.after = {a: b for a, b in zip(self.sequence, self.sequence[1:])}

    def _chain(self, last, n):
        out = []
        while len(out) < n and last in self.after:
            last = self.after[last]
            out.append(last)
        return out

    def available(self, last, n_past):
        return len(self._chain(last, self.max_draft))

    def offer(self, last, n_past, n_max):
        return Offer(self.name, n_max, [1.0 + 0.5 * n for n in range(n_max + 1)])

    def propose(self, last, n_past, n_draft, params, rng):
        return Candidate(self.name, np.asarray(self._chain(last, n_draft), dtype=np.int64), point_mass=True)

    def observe(self, commit):
        for token in commit.tokens:
            if self.sequence:
                self.after[self.sequence[-1]] = int(token)
            self.sequence.append(int(token))

    def close(self):
        self.closed = True


def make(parts):
    return BigramSource(max_draft=min(8, parts.target.n_batch - 1))
'''

PROMPT = "Repeat: red green blue red green blue red green blue red green blue red green blue"


def _register_bigram(tmp_path, monkeypatch) -> None:
    (tmp_path / "bigram_source.py").write_text(BIGRAM_SOURCE)
    spec = importlib.util.spec_from_file_location("bigram_source", tmp_path / "bigram_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(speculation, "SOURCES", (*speculation.SOURCES, module.make))  # the registry line


def test_a_draft_source_is_one_module_and_one_registry_line(tmp_path, monkeypatch, embedded_target):
    _register_bigram(tmp_path, monkeypatch)

    with Session(embedded_target, drafter=None, lookup=False, n_ctx=256, n_threads=1) as s:
        assert [x.name for x in s._sources] == ["bigram"]
        plain = s.generate(PROMPT, max_tokens=32, speculative=False).tokens
        steps = list(s.stream(PROMPT, max_tokens=32, block_size=4))
        assert [t for step in steps for t in step.tokens] == plain
        assert any(step.source == "bigram" and step.n_accepted > 0 for step in steps)
        with s.fork() as forked:
            bigram = forked._sources[0]
            assert forked._sources == [bigram] and bigram is not s._sources[0]
            assert forked.generate(PROMPT, max_tokens=32, block_size=4).tokens == plain
        assert bigram.closed and not s._sources[0].closed
        mine = s._sources[0]
    assert mine.closed


def test_its_tokens_carry_its_name_in_the_steps_the_stats_and_the_chats_colours(tmp_path, monkeypatch, embedded_target):
    _register_bigram(tmp_path, monkeypatch)
    with Session(embedded_target, drafter=None, lookup=False, n_ctx=256, n_threads=1) as s:
        steps = list(s.stream(PROMPT, max_tokens=32, block_size=4))
        stats = s.last_stats
        info = SessionInfo.of(s)
    drafted = [step for step in steps if step.source == "bigram"]
    accepted = sum(step.n_accepted for step in drafted)
    assert accepted > 0
    for step in drafted:
        assert step.provenance == ("bigram",) * step.n_accepted + (TokenSource.BONUS,) * (len(step.tokens) > step.n_accepted)
    assert stats.tokens_by_provenance["bigram"] == accepted == stats.per_source["bigram"].n_accepted
    assert sum(stats.tokens_by_provenance.values()) == stats.n_tokens

    # the chat: a palette colour of its own, in the tokens and in the key to them
    colour = display("bigram")
    assert isinstance(colour, Palette) and display("bigram") is colour
    assert any(kind is colour for step in drafted for _, kind in pieces_of(step))
    assert "bigram" in info.sources()
    key = legend(info.sources())
    assert ("bigram", colour) in key and set(LEGEND) <= set(key)
    assert legend(["dflash", "lookup", "mtp"]) == LEGEND  # the shipped sources keep their own colours


@pytest.mark.parametrize("name", ["plain", "bonus", "prefill"])
def test_a_source_may_not_take_the_name_of_the_targets_own_tokens(tmp_path, monkeypatch, embedded_target, name):
    _register_bigram(tmp_path, monkeypatch)
    monkeypatch.setattr(speculation, "SOURCES", (*speculation.SOURCES[:-1], _renamed(speculation.SOURCES[-1], name)))
    with pytest.raises(ValueError, match=f"may not be named '{name}'"):
        Session(embedded_target, drafter=None, lookup=False, n_ctx=256, n_threads=1)


def _renamed(make, name):
    def make_renamed(parts):
        source = make(parts)
        source.name = name
        return source
    return make_renamed


def test_a_drafters_tokens_are_counted_under_its_kind_and_coloured_as_the_drafters():
    """The drafter's provenance is its source's name, its kind: tokens_by_provenance counts it where
    per_source does (it was 'draft'), and the chat still colours it as the drafter. The embedded target
    and its shipped drafter."""
    with Session(n_ctx=256, n_threads=1, lookup=False) as s:
        kind = s.drafter.kind
        steps = list(s.stream("The capital of France is", max_tokens=32, block_size=4))
        stats = s.last_stats
    assert stats.tokens_by_provenance[kind] == stats.per_source[kind].n_accepted > 0
    assert "draft" not in stats.tokens_by_provenance
    assert all(p == kind for step in steps if step.source == kind for p in step.provenance[: step.n_accepted])
    assert display(kind) is Provenance.DRAFT

"""Issue 34's wall for draft sources: a new one is one module and one line in speculation.SOURCES. Written
here to a file of its own, a bigram source is made by every Session (and each fork), drafts under the policy
like the shipped ones, keeps greedy output exactly the target's, and is closed with its Session."""

from __future__ import annotations

import importlib.util

from dflash_gguf import speculation
from dflash_gguf.session import Session

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


def test_a_draft_source_is_one_module_and_one_registry_line(tmp_path, monkeypatch, embedded_target):
    (tmp_path / "bigram_source.py").write_text(BIGRAM_SOURCE)
    spec = importlib.util.spec_from_file_location("bigram_source", tmp_path / "bigram_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(speculation, "SOURCES", (*speculation.SOURCES, module.make))  # the registry line

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

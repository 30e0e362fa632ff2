"""The decode loop's seams on the real target: a draft source that is not a drafter, the memory interface,
the stats model, and the Session's lifetime and threading rules."""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np
import pytest

from dflash_gguf import SamplingParams, Session
from dflash_gguf.controller import FixedPolicy
from dflash_gguf.config import GenerationConfig
from dflash_gguf.decoding import CacheState, decode_steps
from dflash_gguf.memory import KVTruncation
from dflash_gguf.session import SessionBusyError, SessionClosedError
from dflash_gguf.sources import Candidate, Commit, DraftSource
from dflash_gguf.stats import MIN_BASELINE_CYCLES, collect, speedup
from dflash_gguf.steps import StepKind, TokenSource
from dflash_gguf.target import ClosedError, Target

PROMPT = "The capital of France is"
N_TOKENS = 24


class ScriptSource(DraftSource):
    """Proposes the next tokens of a fixed script, aligned to absolute positions: a source with no model."""

    name = "script"
    provenance = TokenSource.LOOKUP

    def __init__(self, script: dict[int, int], max_draft: int = 4) -> None:
        self.script = script  # position -> token to propose there
        self.max_draft = max_draft
        self.seen: list[int] = []

    def cached(self) -> int:
        return len(self.seen)

    def truncate(self, n: int) -> None:
        del self.seen[n:]

    def available(self, last: int, n_past: int) -> int:
        n = 0
        while n < self.max_draft and n_past + 1 + n in self.script:
            n += 1
        return n

    def propose(self, last, n_past, n_draft, params, rng) -> Candidate:
        tokens = np.array([self.script[n_past + 1 + i] for i in range(n_draft)], dtype=np.int64)
        return Candidate(self.name, tokens, point_mass=True)

    def observe(self, commit: Commit) -> None:
        assert commit.start == len(self.seen), "commits arrive in position order"
        self.seen.extend(commit.tokens)


class CountingMemory(KVTruncation):
    """KV truncation that records what the loop asked of it."""

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.verifies: list[tuple[int, int]] = []
        self.kept: list[tuple[int, int, int]] = []

    def before_verify(self, n_past: int, n_tokens: int) -> None:
        self.verifies.append((n_past, n_tokens))

    def keep(self, n_past: int, block: Sequence[int], n_keep: int) -> None:
        self.kept.append((n_past, len(block), n_keep))
        super().keep(n_past, block, n_keep)


@pytest.fixture(scope="module")
def target(embedded_target):
    with Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as t:
        yield t


def run(target: Target, prompt: list[int], source: DraftSource | None, memory=None, block: int = 5,
        sampling: SamplingParams | None = None):
    cache = CacheState()
    memory = memory or KVTruncation(target)
    s = sampling or SamplingParams()
    config = GenerationConfig(max_tokens=N_TOKENS, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)
    steps = list(
        decode_steps(
            target, prompt, config, cache, memory=memory, sources=[source] if source else [], policy=FixedPolicy(block),
        )
    )
    return steps, cache


def test_a_scripted_source_runs_through_the_real_loop_losslessly(target):
    prompt = target.vocab.tokenize(PROMPT)
    plain, _ = run(target, prompt, None)
    want = [t for s in plain for t in s.tokens]
    assert all(s.kind in (StepKind.PREFILL, StepKind.PLAIN) for s in plain)

    # the right continuation from position len(prompt)+1 on, with every fourth token wrong
    script = {len(prompt) + i: (tok if i % 4 else (tok + 1) % target.n_vocab) for i, tok in enumerate(want)}
    source = ScriptSource(script)
    memory = CountingMemory(target)
    steps, cache = run(target, prompt, source, memory)
    assert [t for s in steps for t in s.tokens] == want
    drafted = [s for s in steps if s.kind is StepKind.DRAFT]
    assert drafted and all(s.source == "script" for s in drafted)
    assert sum(s.n_accepted for s in drafted) > 0 and any(s.n_accepted < s.n_drafted for s in drafted)
    for s in steps[1:]:
        assert len(s.provenance) == len(s.tokens)
        assert s.provenance[: s.n_accepted] == (TokenSource.LOOKUP,) * s.n_accepted
        assert "".join(t for t, _ in s.spans) == s.text
    # the loop verified through the memory, and kept exactly what it accepted
    assert len(memory.kept) == len(steps) - 1 == len(memory.verifies)
    assert [k for _, _, k in memory.kept] == [s.n_accepted + 1 for s in steps[1:]]
    # the source saw every committed token, in order, and the cache holds the same
    assert source.seen == cache.tokens == prompt + want[:-1]


def test_a_point_mass_source_samples_through_the_real_loop(target):
    """A deterministic proposal carries no q: with sampling, the loop accepts each drafted token with the
    target's probability of it (tested for its law in test_session_sampling with lookup drafts)."""
    prompt = target.vocab.tokenize(PROMPT)
    plain, _ = run(target, prompt, None)
    want = [t for s in plain for t in s.tokens]
    script = {len(prompt) + i: tok for i, tok in enumerate(want)}
    params = SamplingParams(temperature=0.7, seed=3)
    steps, _ = run(target, prompt, ScriptSource(script), sampling=params)
    again, _ = run(target, prompt, ScriptSource(script), sampling=params)
    assert [t for s in steps for t in s.tokens] == [t for s in again for t in s.tokens]  # seeded: reproducible
    drafted = [s for s in steps if s.kind is StepKind.DRAFT]
    assert drafted and sum(s.n_accepted for s in drafted) > 0


def test_stats_are_one_view_of_the_steps(target):
    prompt = target.vocab.tokenize(PROMPT)
    plain, _ = run(target, prompt, None)
    want = [t for s in plain for t in s.tokens]
    script = {len(prompt) + i: tok for i, tok in enumerate(want)}
    steps, _ = run(target, prompt, ScriptSource(script))
    b = collect(steps)
    drafted = [s for s in steps if s.drafted]
    assert b.cycles == len(steps) - 1
    assert b.n_drafted == sum(s.n_drafted for s in drafted) and b.n_accepted == sum(s.n_accepted for s in drafted)
    assert b.tau == pytest.approx(sum(s.n_accepted + 1 for s in steps[1:]) / b.cycles)
    stats = b.stats(wall_s=1.0, n_prompt_tokens=len(prompt), n_cached_tokens=0, block_size=5, speculative=True)
    assert stats.per_source["script"].n_accepted == b.n_accepted
    assert stats.tokens_by_provenance["lookup"] == b.n_accepted
    assert stats.acceptance_by_slot[0] == 1.0  # the script is right everywhere


def test_in_reply_speedup_of_a_plain_reply_is_one(target):
    """Like for like: an all-plain reply is compared with its own plain cycles, so it reads 1.0x."""
    steps, _ = run(target, target.vocab.tokenize(PROMPT), None)
    b = collect(steps)
    assert b.plain_cycles >= MIN_BASELINE_CYCLES
    stats = b.stats(wall_s=1.0, n_prompt_tokens=1, n_cached_tokens=0, block_size=None, speculative=False)
    assert stats.in_reply_speedup == pytest.approx(1.0)
    short = collect(steps[: MIN_BASELINE_CYCLES - 1])
    assert short.in_reply_plain_tokens_per_s is None  # too few plain cycles: no figure, not a guess
    assert speedup(None, 10.0) is None and speedup(20.0, 10.0) == 2.0


# -- Session lifetime and threads ----------------------------------------------------------


@pytest.fixture
def session(dflash_gguf_path):
    """A Session of the test's own, for the tests that close it."""
    with Session(drafter=dflash_gguf_path, n_ctx=256, n_batch=64, n_threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def shared(dflash_gguf_path):
    """One Session for the tests that leave it open and compare only replies they made on it themselves."""
    with Session(drafter=dflash_gguf_path, n_ctx=256, n_batch=64, n_threads=1) as s:
        yield s


def test_every_method_of_a_closed_session_raises(session):
    session.close()
    session.close()  # twice is fine
    for call in (
        lambda: session.generate(PROMPT, max_tokens=4),
        lambda: list(session.stream(PROMPT, max_tokens=4)),
        lambda: session.chat([{"role": "user", "content": "hi"}], max_tokens=4),
        lambda: session.tokenize(PROMPT),
        lambda: session.reset(),
        lambda: session.fork(),
        lambda: session.create_completion(PROMPT, max_tokens=4),
    ):
        with pytest.raises(SessionClosedError):
            call()
    with pytest.raises(ClosedError):  # the one closed error of Target, Drafter and Session
        session.generate(PROMPT, max_tokens=4)


def test_close_during_a_stream_ends_it_cleanly(session):
    seen = []
    for step in session.stream(PROMPT, max_tokens=40, block_size=4):
        seen.append(step)
        if len(seen) == 3:
            session.close()
    assert len(seen) == 3 and session.closed


def test_close_from_another_thread_waits_for_the_cycle_not_the_stream(session):
    stream = session.stream(PROMPT, max_tokens=40, block_size=4)
    first = next(stream)
    closer = threading.Thread(target=session.close)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive() and first.kind is StepKind.PREFILL
    assert list(stream) == []  # the stream ends; nothing touches the freed memory


def test_two_threads_on_one_session_are_serialised(shared):
    want = shared.generate(PROMPT, max_tokens=N_TOKENS, block_size=4).tokens
    results, errors = [], []

    def worker():
        try:
            results.append(shared.generate(PROMPT, max_tokens=N_TOKENS, block_size=4).tokens)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and results == [want] * 3


def test_wait_false_refuses_a_second_generation(dflash_gguf_path):
    with Session(drafter=dflash_gguf_path, n_ctx=256, n_batch=64, n_threads=1, wait=False) as s:
        stream = s.stream(PROMPT, max_tokens=8)
        next(stream)
        errors = []
        t = threading.Thread(target=lambda: errors.append(pytest.raises(SessionBusyError, s.generate, PROMPT)))
        t.start()
        t.join(timeout=30)
        assert len(errors) == 1
        with pytest.raises(RuntimeError, match="still iterating"):
            s.generate(PROMPT, max_tokens=2)  # the same thread, inside its own stream
        stream.close()
        assert s.generate(PROMPT, max_tokens=2).tokens  # free again once the stream is closed


@pytest.mark.parametrize("wait", [True, pytest.param(False, marks=pytest.mark.slow)])  # each its own Session
def test_reset_from_another_thread_respects_the_running_generation(dflash_gguf_path, wait):
    """reset() clears the caches a running generation uses: it waits for that generation like another
    generation would (or refuses at once with wait=False), and the stream ends unharmed."""
    with Session(drafter=dflash_gguf_path, n_ctx=256, n_batch=64, n_threads=1, wait=wait) as s:
        want = s.generate(PROMPT, max_tokens=12, block_size=4).tokens
        s.reset()
        stream = s.stream(PROMPT, max_tokens=12, block_size=4)
        got = list(next(stream).tokens)
        errors: list[BaseException] = []

        def reset() -> None:
            try:
                s.reset()
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        t = threading.Thread(target=reset)
        t.start()
        if wait:
            t.join(timeout=1.0)  # cannot end while this thread holds the stream open: a slow machine only waits
            assert t.is_alive() and not errors  # waiting for the stream
        else:
            t.join(timeout=60)  # refused at once, however loaded the machine
            assert not t.is_alive() and isinstance(errors[0], SessionBusyError)
        got += [tok for step in stream for tok in step.tokens]
        t.join(timeout=30)
        assert not t.is_alive() and got == want
        if wait:
            assert not errors and s.memory.target.pos_max(0) == -1  # the reset ran once the stream ended


def test_a_generation_cut_short_by_close_raises(dflash_gguf_path):
    """generate() whose Session is closed from another thread mid-way raises instead of returning a
    truncated text that looks finished. The Session's own steps are held after the first one until close()
    has returned, so the generation is mid-way however fast the machine (not by a long reply)."""
    s = Session(drafter=dflash_gguf_path, n_ctx=512, n_batch=64, n_threads=1)
    first_step, closed = threading.Event(), threading.Event()
    steps = s._steps

    def held(*args, **kwargs):
        it = steps(*args, **kwargs)
        step = next(it)
        assert step.finish_reason is None  # the generation has more to do
        yield step
        first_step.set()
        closed.wait()
        yield from it

    s._steps = held
    outcome: list[object] = []
    t = threading.Thread(target=lambda: outcome.append(pytest.raises(SessionClosedError, s.generate, PROMPT,
                                                                     max_tokens=32, speculative=False)))
    t.start()
    try:
        assert first_step.wait(timeout=120)
        s.close()
    finally:
        closed.set()
    t.join(timeout=60)
    assert not t.is_alive() and len(outcome) == 1


def test_fork_shares_weights_and_keeps_its_own_caches(shared):
    want = shared.generate(PROMPT, max_tokens=N_TOKENS, block_size=4).tokens
    with shared.fork() as other:
        assert other.target.model == shared.target.model  # one loaded model
        assert other.target.ctx != shared.target.ctx
        assert other.generate(PROMPT, max_tokens=N_TOKENS, block_size=4).tokens == want
        shared.reset()
        assert other.chat([{"role": "user", "content": "hi"}], max_tokens=4).tokens
    assert shared.generate(PROMPT, max_tokens=N_TOKENS, block_size=4).tokens == want  # closing the fork freed only its own


def test_calibration_never_blocks_a_valid_call(dflash_gguf_path):
    """A generation that filled the context, then the first adaptive one: calibration finds room."""
    with Session(drafter=dflash_gguf_path, n_ctx=64, n_batch=64, n_threads=1) as s:
        r = s.generate(PROMPT, max_tokens=200, speculative=False)
        assert r.finish_reason == "length"
        assert s.generate(PROMPT, max_tokens=8).tokens


def test_a_drafter_block_larger_than_the_context(dflash_gguf_path):
    with Session(drafter=dflash_gguf_path, n_ctx=12, n_batch=12, n_threads=1) as s:
        assert s.drafter.block_size > 12 - len(s.tokenize(PROMPT))
        r = s.generate(PROMPT, max_tokens=20)
        assert r.finish_reason == "length" and r.tokens


@pytest.mark.parametrize("bad", [{"speculative": "no"}, {"speculative": 1}, {"stop": {"a": 1}}, {"stop": [1]}])
def test_wrongly_typed_arguments_are_refused(shared, bad):
    with pytest.raises(TypeError):
        shared.generate(PROMPT, max_tokens=2, **bad)


def test_the_last_step_names_the_stop_string_that_ended_it(shared):
    text = shared.generate(PROMPT, max_tokens=N_TOKENS, block_size=4).text
    stop = text.strip().split()[2]
    last = list(shared.stream(PROMPT, max_tokens=N_TOKENS, block_size=4, stop=["\u2603", stop]))[-1]
    assert last.finish_reason == "stop" and last.stop_sequence == stop
    assert list(shared.stream(PROMPT, max_tokens=3))[-1].stop_sequence is None

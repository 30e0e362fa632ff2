"""MTP heads as a draft source (issue 38), on a tiny random Qwen3.5 whose one MTP head is random too.

The oracle is upstream's own MTP driver (common_speculative_impl_draft_mtp) run by scripts/mtp_oracle.cpp
on the same GGUF: MTPSource must draft exactly its tokens, cycle by cycle, through forced acceptances (the
cross-batch carry after k accepted drafts), greedy ones and plain cycles. A random head's drafts are
nearly always rejected, so the Session tests roll the hybrid target back almost every cycle; the
reference is llama_cpp.Llama's own greedy loop (test_hybrid_session's, with its near-tie check: the
fixture's trunk is that module's qwen35).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf import Session, Target
from dflash_gguf.mtp import MTP_SOURCE, MTPSource, mtp_unusable_reason
from dflash_gguf.sampling import SamplingParams
from dflash_gguf.sources import Commit

pytestmark = pytest.mark.slow  # every test needs the MTP fixture, built with upstream's converter (~40 s)

REPO = Path(__file__).resolve().parent.parent
N_CTX, N_BATCH = 512, 64  # as scripts/mtp_oracle.cpp makes its contexts
N_RS_SEQ = 16
# (n_draft, n_commit): forced commits move the carry past accepted drafts; "g": the target's greedy verdict
CYCLES = [(4, 0), (4, 2), (0, 0), (3, 3), (5, "g"), (1, 1), (6, "g"), (0, 0), (0, 0), (2, "g"), (8, 5), (3, "g")]
PROMPTS = ([1, 504, 3000, 77, 9123, 45, 600, 12000, 5], [42, 7, 42, 7, 42, 19000, 3, 3, 3, 811, 2500, 6, 6])


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    """scripts/mtp_oracle.cpp built by scripts/build_mtp_oracle.sh (a few seconds: no llama.cpp build)."""
    out = tmp_path_factory.mktemp("oracle") / "mtp_oracle"
    done = subprocess.run(["bash", str(REPO / "scripts/build_mtp_oracle.sh"), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def upstream_drafts(oracle: Path, model: Path, prompt: list[int], cycles, heads: Path | None = None) -> list[list[int]]:
    """What upstream's driver drafts each cycle (heads: an MTP model of its own, as gemma4's assistant)."""
    spec = ",".join(f"{n}:{k}" for n, k in cycles)
    args = [str(oracle), str(model), ",".join(map(str, prompt)), spec, "1", *([str(heads)] if heads else [])]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [[int(t) for t in line.split()[1:]] for line in out.splitlines() if line.startswith("draft")]


def our_drafts(model: Path, prompt: list[int], cycles, heads: Path | None = None, setup=None,
               after=None) -> list[list[int]]:
    """The same schedule as the oracle's, with MTPSource told each commit as the decode loop tells it
    (setup(source), where given, first; after(target, committed, last) at the end)."""
    with Target.open(model, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, n_rs_seq=N_RS_SEQ, load_mtp=heads is None) as t:
        source = MTPSource(t, heads=heads, max_draft=16)
        if setup is not None:
            setup(source)
        try:
            seq: list[int] = list(prompt)
            t.decode(prompt, 0, logits="last")
            source.observe(Commit(0, prompt, sequence=seq))
            last = int(t.output_logits()[-1].argmax())
            out = []
            for n, k in cycles:
                n_past = len(seq)
                drafts = source.propose(last, n_past, n, SamplingParams(), np.random.default_rng(0)).tokens.tolist() if n else []
                out.append(drafts)
                block = [last] + drafts
                t.decode(block, n_past, logits=True)
                argmax = t.output_logits().argmax(axis=1)
                if k == "g":
                    k = 0
                    while k < len(drafts) and argmax[k] == drafts[k]:
                        k += 1
                k = min(k, len(drafts))
                t.remove(0, n_past + 1 + k)
                seq += block[: k + 1]
                source.observe(Commit(n_past, block[: k + 1], sequence=seq))
                last = int(argmax[k])
            if after is not None:
                after(t, seq, last)
            return out
        finally:
            source.close()


@pytest.mark.parametrize("prompt", PROMPTS, ids=["varied", "repeats"])
def test_drafts_what_upstreams_driver_drafts(oracle, mtp_target, prompt):
    want = upstream_drafts(oracle, mtp_target, prompt, CYCLES)
    assert [len(d) for d in want] == [n for n, _ in CYCLES]
    assert our_drafts(mtp_target, prompt, CYCLES) == want


def test_heads_shipped_apart_draft_as_the_heads_inside(oracle, mtp_target, hybrid_models):
    """mtp-qwen35.gguf (upstream's --mtp) beside the trunk converted without its head drafts what the head
    inside qwen35-mtp.gguf drafts, and so what upstream's driver drafts."""
    prompt = PROMPTS[1]
    want = upstream_drafts(oracle, mtp_target, prompt, CYCLES)
    heads = mtp_target.parent / "mtp-qwen35.gguf"
    assert our_drafts(hybrid_models.target("qwen35"), prompt, CYCLES, heads=heads) == want


def test_heads_that_do_not_fit_the_target_are_refused(mtp_target, embedded_target):
    with Target.open(embedded_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as t:
        with pytest.raises(ValueError, match="not MTP heads for this target: it is a qwen35, the target a llama"):
            MTPSource(t, heads=mtp_target.parent / "mtp-qwen35.gguf")
    with Target.open(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as t:
        with pytest.raises(ValueError, match="not a GGUF file"):
            MTPSource(t, heads=mtp_target.parent / "qwen35-mtp-hf" / "config.json")


def test_the_draft_comparison_sees_a_lost_carry(oracle, mtp_target):
    """Not vacuous: pairing a batch's first token with the wrong row (no carry) changes the drafts."""
    prompt = PROMPTS[0]
    want = upstream_drafts(oracle, mtp_target, prompt, CYCLES[:2])
    with Target.open(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, n_rs_seq=N_RS_SEQ, load_mtp=True) as t:
        source = MTPSource(t, max_draft=16)
        try:
            t.decode(prompt, 0, logits="last")
            source.observe(Commit(0, prompt, sequence=list(prompt)))
            source._rows.view()[-1] = 0.0  # the carry into the first draft, lost
            got = source.propose(int(t.output_logits()[-1].argmax()), len(prompt), 4, SamplingParams(),
                                 np.random.default_rng(0)).tokens.tolist()
        finally:
            source.close()
    assert got != want[0]


# --- chained heads (step35) -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def step35(tmp_path_factory, embedded_target):
    """Tiny random Step3p5 targets (attention only) by number of chained MTP heads: tests/mtp_fixtures.py."""
    from mtp_fixtures import build_step35_target

    directory = tmp_path_factory.mktemp("step35")
    return {n: build_step35_target(directory, embedded_target, n_heads=n) for n in (1, 3)}


@pytest.mark.parametrize("prompt", PROMPTS, ids=["varied", "repeats"])
def test_chained_heads_draft_what_upstreams_driver_drafts(oracle, step35, prompt):
    """Three chained heads: draft i is head i's (at most three a cycle, as upstream caps n_max), each head's
    own layer holding the committed positions; carries and rollbacks as with one head."""
    want = upstream_drafts(oracle, step35[3], prompt, CYCLES)
    assert [len(d) for d in want] == [min(n, 3) for n, _ in CYCLES]
    assert our_drafts(step35[3], prompt, CYCLES) == want


def test_the_chained_comparison_sees_a_head_without_its_kv(oracle, step35):
    """Not vacuous: heads 1 and 2 attending to no committed positions of their own draft other tokens."""
    from dflash_gguf.mtp import MTPHeads

    def first_head_only(source):
        heads = source.heads

        def process(tokens, start, rows):
            heads.n_heads = 1
            try:
                MTPHeads.process(heads, tokens, start, rows)
            finally:
                heads.n_heads = 3
        heads.process = process

    prompt = PROMPTS[0]
    want = upstream_drafts(oracle, step35[3], prompt, CYCLES)
    got = our_drafts(step35[3], prompt, CYCLES, setup=first_head_only)
    assert got[0][0] == want[0][0] and got[0][1:] != want[0][1:]  # head 0 keeps its KV, the others drafted blind


@pytest.mark.parametrize("block", [5, None])
def test_chained_heads_are_lossless_in_a_session(step35, block):
    """Greedy with three chained heads is plain decoding (a block of 5 asks four drafts of three heads: they
    draft three); sampled, their drafts carry the heads' own laws, as many rows as drafts."""
    with Session(step35[3], n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, lookup=False) as s:
        assert s.mtp and s._mtp.max_draft == 3
        want = s.generate("Good morning!", max_tokens=32, speculative=False).tokens
        s.reset()
        r = s.generate("Good morning!", max_tokens=32, block_size=block)
        assert r.tokens == want and r.stats.per_source[MTP_SOURCE].n_drafted > 0
        s.reset()
        r = s.generate("Good morning!", max_tokens=24, temperature=1.0, seed=3, block_size=5)
        mtp = r.stats.per_source[MTP_SOURCE]
        assert len(r.tokens) == 24 and mtp.n_drafted > 0 and mtp.n_drafted <= 3 * r.stats.cycles


@pytest.mark.parametrize("block", [4, None])
@pytest.mark.parametrize("layout", ["chained", "shared-memory"])
def test_heads_draft_paths_that_verify_losslessly_where_trees_are_on(step35, gemma4, layout, block):
    """tree_nodes on an attention-only target (trees verifiable: a unified cache, a sequence per leaf, lookup
    shaping trees): the heads' draft is one path, verified as the linear block it is, and greedy output is
    plain decoding."""
    target, heads = (step35[3], None) if layout == "chained" else gemma4
    with Session(target, heads, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, tree_nodes=8) as s:
        assert s.tree_disabled_reason is None and s.target.kv_unified and s.target.n_seq_max == 7
        want = s.generate("Good morning!", max_tokens=32, speculative=False).tokens
        s.reset()
        steps = list(s.stream("Good morning!", max_tokens=32, block_size=block))
    drafted = [st for st in steps if st.source == MTP_SOURCE]
    assert [t for st in steps for t in st.tokens] == want
    assert drafted and all(st.tree_nodes == 0 and 1 <= st.n_drafted <= 3 for st in drafted)


# --- the shared-memory layout (gemma4) -------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory, embedded_target):
    """A tiny random Gemma 4 target and its random assistant (tests/mtp_fixtures.py)."""
    from mtp_fixtures import build_gemma4_pair

    return build_gemma4_pair(tmp_path_factory.mktemp("gemma4"), embedded_target)


@pytest.mark.parametrize("prompt", PROMPTS, ids=["varied", "repeats"])
def test_the_shared_memory_layout_drafts_what_upstreams_driver_drafts(oracle, gemma4, prompt):
    """gemma4's assistant, a model of its own reading the target's KV: no catch-up pass, every draft token at
    pos0 after the carry; the target's KV is left as a plain decode leaves it."""
    target, assistant = gemma4
    want = upstream_drafts(oracle, target, prompt, CYCLES, heads=assistant)
    assert [len(d) for d in want] == [n for n, _ in CYCLES]

    def target_untouched(t, committed, last):
        t.decode([last], len(committed))
        got = t.output_logits()[-1].copy()
        with Target.open(target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as fresh:
            fresh.decode(committed + [last], 0, logits="last")
            alone = fresh.output_logits()[-1]
            assert got.argmax() == alone.argmax() and np.abs(got - alone).max() < 1e-2

    assert our_drafts(target, prompt, CYCLES, heads=assistant, after=target_untouched) == want


def test_the_shared_memory_layouts_state_is_the_carry_alone(gemma4):
    """Its heads hold no KV (the target's state does): a snapshot is the carry and the waiting rows, and a
    restore drafts what the source would have drafted."""
    target, assistant = gemma4
    prompt = PROMPTS[0]
    with Target.open(target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as t:
        source = MTPSource(t, heads=assistant)
        try:
            assert source.heads.mem_shared and not source.heads.chained and source.heads.n_heads == 2
            t.decode(prompt, 0)
            source.observe(Commit(0, prompt, sequence=list(prompt)))
            state = source.snapshot()
            assert source.heads.save_state() == b"" and len(state) == 4 * 64 + 4 + (4 + 4 * 64) * len(prompt)
            want = source.propose(7, len(prompt), 3, SamplingParams(), np.random.default_rng(0)).tokens.tolist()
            source.truncate(0)
            source.restore(state, len(prompt))
            assert source.propose(7, len(prompt), 3, SamplingParams(), np.random.default_rng(0)).tokens.tolist() == want
            with pytest.raises(ValueError):
                source.restore(state + b"\0" * 8, len(prompt))
        finally:
            source.close()


def drive(target: Target, source: MTPSource, prompt: list[int], cycles: int = 6) -> tuple[list[list[int]], list[int]]:
    """Greedy speculative cycles of three drafts by hand (prefill, propose, verify, roll back, observe):
    what it drafted each cycle, and what it committed."""
    seq = list(prompt)
    target.decode(prompt, 0, logits="last")
    source.observe(Commit(0, prompt, sequence=seq))
    last, drafts = int(target.output_logits()[-1].argmax()), []
    for _ in range(cycles):
        n = len(seq)
        d = source.propose(last, n, 3, SamplingParams(), np.random.default_rng(0)).tokens.tolist()
        drafts.append(d)
        target.decode([last] + d, n, logits=True)
        argmax = target.output_logits().argmax(axis=1)
        k = 0
        while k < len(d) and argmax[k] == d[k]:
            k += 1
        target.remove(0, n + 1 + k)
        seq += ([last] + d)[: k + 1]
        source.observe(Commit(n, ([last] + d)[: k + 1], sequence=seq))
        last = int(argmax[k])
    return drafts, seq


def test_the_shared_memory_layout_drafts_on_sequences_of_a_shared_context(gemma4):
    """The assistant on sequences of a shared target context reads each sequence's own KV stream: each drafts
    and commits what it does on a context of its own (the second sequence first, so ids do not line up)."""
    from dflash_gguf.batching import SharedContext

    target, assistant = gemma4
    alone = []
    for prompt in PROMPTS:
        with Target.open(target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as t:
            source = MTPSource(t, heads=assistant)
            try:
                alone.append(drive(t, source, prompt))
            finally:
                source.close()
    owner = Target.open(target, n_ctx=2 * N_CTX, n_batch=N_BATCH, n_threads=1, n_seq_max=2, kv_unified=False)
    context = SharedContext(owner)
    sequences = [context.sequence() for _ in PROMPTS]
    sources = [MTPSource(t, heads=assistant) for t in sequences]
    try:
        assert sources[0].heads._ctx is sources[1].heads._ctx and sources[1].heads.mem_shared
        with pytest.raises(ValueError, match="the shared context's MTP heads are .*gemma4-assistant.gguf, not the"):
            MTPSource(sequences[0])  # the target's own heads beside the assistant: one MTP context serves them all
        for i in (1, 0):
            assert drive(sequences[i], sources[i], PROMPTS[i]) == alone[i]
        assert context.mtp_context is not None
    finally:
        for s in sources:
            s.close()
        for t in sequences:
            t.close()
    assert context.mtp_context is None and owner.closed


@pytest.mark.parametrize("n_heads", [1, 3])
def test_sequences_of_a_shared_context_draft_with_their_heads_at_once(step35, n_heads):
    """Three Sessions, sequences of one target context (issue 37), the heads drafting every cycle (a fixed
    block): their MTP decodes go out together (Stage.MTP), and each sequence drafts and replies exactly what
    it drafts and replies alone."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from dflash_gguf.batching import Stage

    prompts = ["What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?"]
    settings = dict(n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, lookup=False)

    def run(session, prompt):
        r = session.generate(prompt, max_tokens=24, block_size=3)
        return r.tokens, r.stats.per_source[MTP_SOURCE].n_drafted

    expected = []
    for p in prompts:  # each on a cold context: a reset one holds its cells in another order, which moves the
        with Session(step35[n_heads], **settings) as solo:  # random heads' near-flat logits across ties
            log = spy_drafts(solo)
            expected.append((*run(solo, p), log))
    first = Session(step35[n_heads], sequences=len(prompts), **settings)
    sessions = [first] + [first.fork() for _ in prompts[1:]]
    try:
        context = first.target.shared
        context.max_wait_s = 60.0  # batches wait for every busy sequence: no timeout race
        assert all(s.mtp and s._mtp.heads.n_heads == n_heads for s in sessions)
        logs = [spy_drafts(s) for s in sessions]
        start = threading.Barrier(len(prompts))

        def one(i):
            start.wait()
            return (*run(sessions[i], prompts[i]), logs[i])

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(one, range(len(prompts))))
        assert got == expected
        assert all(n_drafted > 0 for _, n_drafted, _ in got)
        assert context.shared_passes[Stage.MTP] > 0
    finally:
        for s in sessions:
            s.close()
    assert context.mtp_context is None  # freed with its last sequence


def test_the_prompt_cache_restores_the_heads_into_another_sequence(step35, tmp_path):
    """One sequence's entry, MTP part included, restores into another sequence of the shared context (a
    conversation resumed on another slot): the same drafts, cycle for cycle, and the heads left where the
    miss left them (the same carry and waiting rows, and the same next draft from the restored KV)."""
    from dflash_gguf.prompt_cache import PromptCache

    cache = PromptCache(ram_bytes=1 << 26, directory=tmp_path)
    prompt = "The quick brown fox jumps over the lazy dog. " * 3 + "Continue the story:"
    with Session(step35[3], n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, lookup=False, sequences=2,
                 prompt_cache=cache) as first:
        miss = list(first.stream(prompt, max_tokens=16, block_size=3))
        assert first.last_stats.prompt_cache.stored and first.last_stats.prompt_cache.tier is None
        with first.fork() as second:
            assert second.target.seq_id != first.target.seq_id
            hit = list(second.stream(prompt, max_tokens=16, block_size=3))
            stats = second.last_stats
            states, nexts = [], []
            for source in (first._mtp, second._mtp):
                state = source.snapshot()  # the KV's bytes name the stream: compared by what they draft
                states.append(state[: 4 * 64 + 4 + (4 + 4 * 64) * int.from_bytes(state[256:260], "little")])
                nexts.append(source.propose(miss[-1].tokens[-1], source.cached(), 3, SamplingParams(),
                                            np.random.default_rng(0)).tokens.tolist())
    assert stats.prompt_cache.tier == "ram" and stats.n_cached_tokens > 0
    assert [(s.tokens, s.source, s.n_drafted, s.n_accepted) for s in hit] == \
        [(s.tokens, s.source, s.n_drafted, s.n_accepted) for s in miss]
    assert stats.per_source[MTP_SOURCE].n_drafted > 0
    assert states[0] == states[1] and nexts[0] == nexts[1] and len(nexts[0]) == 3


# --- the Session ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(mtp_target):
    from test_hybrid_session import MARGIN, N_TOKENS, PROMPT, plain_greedy

    tokens, gap = plain_greedy(mtp_target, PROMPT, N_TOKENS)
    assert gap > MARGIN, f"a near tie ({gap:.4f}) in the reference: pick another prompt"
    return PROMPT, tokens


def open_session(target: Path, **options) -> Session:
    return Session(target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, n_rs_seq=N_RS_SEQ, **options)


def test_a_target_with_mtp_heads_drafts_with_them_by_default(mtp_target, hybrid_models):
    with open_session(mtp_target) as s:
        assert [src.name for src in s._sources] == ["lookup", MTP_SOURCE]
        assert s.target.n_mtp_heads == 1
    with open_session(mtp_target, lookup=False) as s:
        assert [src.name for src in s._sources] == [MTP_SOURCE]
    with open_session(hybrid_models.target("qwen35")) as s:  # the same trunk, converted without its head
        assert [src.name for src in s._sources] == ["lookup"]


def test_heads_not_loaded_are_refused_before_libllama_sees_them(mtp_target):
    with Target.open(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as t:  # load_mtp=False
        assert t.n_mtp_heads == 0
        assert "no MTP heads loaded" in mtp_unusable_reason(t)
        with pytest.raises(ValueError, match="no MTP heads loaded"):
            MTPSource(t)
    with Target.open(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, load_mtp=True) as t:
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="max_draft"):
                MTPSource(t, max_draft=bad)


@pytest.mark.parametrize("block", [2, 4, 8, None])
def test_greedy_output_is_plain_decoding_with_mtp_alone(mtp_target, reference, block):
    prompt, want = reference
    with open_session(mtp_target, lookup=False) as s:
        r = s.generate(prompt, max_tokens=len(want), block_size=block)
        assert r.tokens == want
        mtp = r.stats.per_source.get(MTP_SOURCE)
        assert mtp is not None and mtp.n_drafted > 0
        if block is not None:
            # a fixed block drafts every cycle but the last (max_tokens leaves it no room for a draft)
            per_cycle = min(block - 1, s._mtp.max_draft)
            assert r.stats.plain_cycles <= 1 and mtp.n_drafted >= (r.stats.cycles - 1) * per_cycle // 2


@pytest.mark.parametrize("block", [4, None])
def test_greedy_output_is_plain_decoding_with_mtp_and_lookup(mtp_target, reference, block):
    """Both sources offer every cycle. This random model never repeats itself, so lookup finds no match to
    draft from here: what this holds is that lookup's presence changes nothing (its index and MTP's context
    follow the same commits); the arbitration itself is AdaptivePolicy's, tested in test_controller."""
    prompt, want = reference
    with open_session(mtp_target) as s:
        assert [src.name for src in s._sources] == ["lookup", MTP_SOURCE]
        r = s.generate(prompt, max_tokens=len(want), block_size=block)
        assert r.tokens == want
        assert r.stats.per_source[MTP_SOURCE].n_drafted > 0
        assert s._lookup.cached() == s._mtp.cached() == len(s._cache.tokens)


@pytest.mark.parametrize("block", [4, None])
def test_greedy_output_is_plain_decoding_with_mtp_beside_a_dflash_drafter(mtp_target, hybrid_models, reference, block):
    """The trunk's DFlash drafter (converted against the same trunk without its head: the same fingerprint)
    and the heads, both offered every cycle: the policy arbitrates, a fixed block drafts from the first."""
    prompt, want = reference
    with Session(mtp_target, hybrid_models.drafter("qwen35"), n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1,
                 n_rs_seq=N_RS_SEQ, lookup=False) as s:
        assert [src.name for src in s._sources] == [MTP_SOURCE, "dflash"] and s.mtp
        r = s.generate(prompt, max_tokens=len(want), block_size=block)
        assert r.tokens == want
        if block is not None:
            assert r.stats.per_source[MTP_SOURCE].n_drafted > 0


def test_greedy_output_under_a_grammar_is_plain_decoding_with_mtp(mtp_target):
    """A grammar that admits the random head's drafts (no digits), so they are verified under the mask."""
    regex = r"[^0-9]{0,300}"
    with open_session(mtp_target, lookup=False) as s:
        want = s.generate("Good morning!", max_tokens=32, regex=regex, speculative=False)
        assert want.stats.n_tokens == 32
        for block in (3, None):
            s.reset()
            r = s.generate("Good morning!", max_tokens=32, regex=regex, block_size=block)
            assert r.tokens == want.tokens, f"block {block}"
            assert r.stats.per_source[MTP_SOURCE].n_drafted > 0, f"block {block}"


def test_tokens_the_heads_drafted_carry_their_own_provenance_and_colour(mtp_target):
    """Sampled hot (temperature 3 flattens both laws until rejection keeps some of the random head's drafts):
    each accepted MTP draft is TokenSource.MTP, drawn in the chat's MTP colour, the cycle's last the bonus."""
    from dflash_gguf.steps import TokenSource
    from dflash_gguf.tui.provenance import Provenance, pieces_of

    with open_session(mtp_target, lookup=False) as s:
        steps = [step for seed in range(4)
                 for step in s.stream("Good morning!", max_tokens=24, temperature=3.0, seed=seed, block_size=2)]
    drafted = [step for step in steps if step.source == MTP_SOURCE]
    assert drafted and all(step.provenance == (TokenSource.MTP,) * step.n_accepted + (TokenSource.BONUS,)
                           for step in drafted)
    accepted = [step for step in drafted if step.n_accepted]
    assert accepted, "some sampled drafts pass"
    assert any(kind is Provenance.MTP for step in accepted for _, kind in pieces_of(step))


def test_the_chat_names_the_heads_among_its_sources(mtp_target):
    """dflash-chat on a target whose heads draft: the subtitle and the sources panel name mtp, with its count."""
    from test_tui_app import SHORT_PROMPT, options, rows, run_app, send_and_wait

    from dflash_gguf.tui.app import ChatApp

    with open_session(mtp_target) as s:
        app = ChatApp(s, options(max_tokens=12, block_size=2))

        async def scenario(pilot) -> None:
            await send_and_wait(pilot, SHORT_PROMPT)
            assert str(app.sub_title).startswith("lookup + mtp · block 2")
            mtp = app.last_stats.per_source()[MTP_SOURCE]
            assert mtp.n_drafted > 0
            assert rows(app, "#sources")["mtp"] == f"{mtp.n_accepted}/{mtp.n_drafted} accepted ({mtp.acceptance_rate:.0%})"

        run_app(app, scenario)


def test_random_heads_are_learnt_to_fail(mtp_target, reference):
    """A random head's drafts fail, and MTP's own acceptance model learns it: what it offers falls from its
    prior. (Whether the policy then drafts depends on the measured costs: scripts/bench_mtp.py measures it.)"""
    prompt, want = reference
    with open_session(mtp_target, lookup=False) as s:
        prior = s._mtp.offer(0, 0, 3).expected
        r = s.generate(prompt, max_tokens=len(want), block_size=4)  # every cycle drafts: evidence to learn from
        mtp = r.stats.per_source[MTP_SOURCE]
        assert mtp.n_drafted > 30 and mtp.n_accepted <= mtp.n_drafted // 10
        learnt = s._mtp.offer(want[-1], len(s._cache.tokens), 3).expected
        assert learnt[1] < 1 + 0.5 * (prior[1] - 1) and learnt[-1] < prior[-1]


def test_sampled_tokens_after_an_mtp_draft_follow_the_target_distribution(mtp_target):
    """Block 2 at temperature 0.6: the second token of a reply is verified against a draft the head sampled
    from its own distribution q (accepted with min(1, p/q), else drawn from the residual). Its law given
    the first token is the target's p; a loop that took the head's drafts unverified would follow q."""
    from chi_square import chi_square_p_value
    from test_session_sampling import ALPHA, next_token_probs

    params = SamplingParams(temperature=0.6)
    with open_session(mtp_target, lookup=False) as s, \
            Target.open(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as reference:
        runs = [s.generate("Good morning!", max_tokens=3, temperature=0.6, seed=seed, block_size=2) for seed in range(240)]
        runs = [r for r in runs if len(r.tokens) >= 2]
        assert all(r.stats.per_source[MTP_SOURCE].n_drafted >= 1 for r in runs)
        firsts = [r.tokens[0] for r in runs]
        first = max(set(firsts), key=firsts.count)
        after = [r.tokens[1] for r in runs if r.tokens[0] == first]
        assert len(after) > 60
        prompt = reference.vocab.tokenize("Good morning!")
        probs = next_token_probs(reference, prompt + [first], params)
        assert chi_square_p_value(after, probs) > ALPHA
        with Target.open(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, load_mtp=True) as t:
            source = MTPSource(t)
            try:
                t.decode(prompt, 0)
                source.observe(Commit(0, prompt, sequence=list(prompt)))
                q = source.propose(first, len(prompt), 1, params, np.random.default_rng(0)).q[0]
            finally:
                source.close()
        assert 0.5 * np.abs(q - probs).sum() > 0.3  # the head's law is far from the target's
        assert chi_square_p_value(after, q) < ALPHA


def test_a_prompt_cache_hit_drafts_what_the_miss_drafted(mtp_target, reference, tmp_path):
    """The entry holds the MTP context's KV and the carry row with the target's state, so a resent prompt
    restored from the cache leaves the head exactly where the cold prefill left it: the same drafts every
    cycle, hence the same acceptances, and the same MTP state at the end, byte for byte (without the MTP
    part the restored positions would hold no MTP state, and the state would differ)."""
    from dflash_gguf.prompt_cache import PromptCache

    prompt, want = reference
    cache = PromptCache(ram_bytes=1 << 26, directory=tmp_path)
    with Session(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, n_rs_seq=N_RS_SEQ, lookup=False,
                 prompt_cache=cache) as s:
        miss = list(s.stream(prompt, max_tokens=len(want), block_size=3))
        assert s.last_stats.prompt_cache.tier is None and s.last_stats.prompt_cache.stored
        miss_state = s._mtp.snapshot()
        with s.fork() as other:
            hit = list(other.stream(prompt, max_tokens=len(want), block_size=3))
            stats = other.last_stats
            hit_state = other._mtp.snapshot()
    assert stats.prompt_cache.tier == "ram" and stats.n_cached_tokens > 0
    assert [t for step in hit for t in step.tokens] == [t for step in miss for t in step.tokens] == want
    assert [(step.source, step.n_drafted, step.n_accepted) for step in hit] == \
        [(step.source, step.n_drafted, step.n_accepted) for step in miss]
    assert stats.per_source[MTP_SOURCE].n_drafted > 0
    assert miss_state is not None and hit_state == miss_state


def test_an_mtp_state_restores_exactly_or_leaves_nothing_held(mtp_target):
    """A snapshot holds the processed KV and the tokens still waiting, with their rows: restored, the source
    drafts what it would have; bytes that are no such state leave it empty, never half restored."""
    prompt, more = PROMPTS[0], [77, 78, 79]
    with Target.open(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, n_rs_seq=N_RS_SEQ, load_mtp=True) as t:
        source = MTPSource(t)
        try:
            t.decode(prompt, 0)
            source.observe(Commit(0, prompt, sequence=list(prompt)))
            source.propose(5, len(prompt), 3, SamplingParams(), np.random.default_rng(0))  # the prompt processed
            t.decode(more, len(prompt))
            source.observe(Commit(len(prompt), more, sequence=prompt + more))  # waiting, not processed
            n = len(prompt) + len(more)
            state = source.snapshot()
            want = source.propose(9, n, 3, SamplingParams(), np.random.default_rng(0)).tokens.tolist()
            source.truncate(0)
            for bad, error in ((state[:16], ValueError), (state[:-40], RuntimeError)):
                with pytest.raises(error):
                    source.restore(bad, n)
                assert source.cached() == 0
            with pytest.raises(RuntimeError, match="after restoring"):
                source.restore(state, len(prompt) - 1)  # the KV reaches past the positions claimed
            assert source.cached() == 0
            source.restore(state, n)
            assert source.cached() == n and source.snapshot() == state
            assert source.propose(9, n, 3, SamplingParams(), np.random.default_rng(0)).tokens.tolist() == want
        finally:
            source.close()


def test_a_long_wait_drops_the_oldest_waiting_tokens(mtp_target, reference, monkeypatch):
    """Past 2 x MAX_WAITING waiting tokens the oldest are held with no MTP state (a head set aside costs no
    pass): the source keeps its count of positions, drafts after the holes, and a Session stays lossless."""
    from dflash_gguf import mtp

    monkeypatch.setattr(mtp, "MAX_WAITING", 8)
    with Target.open(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, n_rs_seq=N_RS_SEQ, load_mtp=True) as t:
        source = MTPSource(t)
        try:
            seq = list(PROMPTS[1])
            t.decode(seq, 0)
            source.observe(Commit(0, list(seq), sequence=seq))
            for i in range(30):  # a plain streak: one token a cycle, no draft
                t.decode([100 + i], len(seq))
                seq.append(100 + i)
                source.observe(Commit(len(seq) - 1, [100 + i], sequence=seq))
                assert source.cached() == len(seq) and len(source._tokens) <= 16
            held = source._n
            assert held > 0 and source.heads._live().pos_max() == -1  # dropped, never processed
            assert len(source.propose(5, len(seq), 3, SamplingParams(), np.random.default_rng(0)).tokens) == 3
            assert source.heads._live().pos_max() == len(seq) - 1 and source._n == len(seq)
        finally:
            source.close()
    prompt, want = reference
    with open_session(mtp_target, lookup=False) as s:
        assert s.generate(prompt, max_tokens=len(want)).tokens == want


def test_waiting_tokens_are_processed_at_the_end_until_the_head_is_set_aside(mtp_target):
    """finish() brings the head up to date while its offers are taken (so its next draft is timed alone), and
    leaves the tokens waiting once the policy has declined SET_ASIDE_AFTER offers in a row."""
    from dflash_gguf.mtp import SET_ASIDE_AFTER

    with Target.open(mtp_target, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, n_rs_seq=N_RS_SEQ, load_mtp=True) as t:
        source = MTPSource(t)
        try:
            seq = list(PROMPTS[0])
            t.decode(seq, 0)
            source.observe(Commit(0, list(seq), sequence=seq))
            source.finish()
            assert source.heads._live().pos_max() == len(seq) - 1 and not source._tokens
            for i in range(SET_ASIDE_AFTER):  # offered every cycle, never taken
                source.offer(seq[-1], len(seq), 3)
                t.decode([200 + i], len(seq))
                seq.append(200 + i)
                source.observe(Commit(len(seq) - 1, [200 + i], sequence=seq))
                if i == SET_ASIDE_AFTER - 2:
                    source.finish()  # one offer short: still processed
                    assert not source._tokens
            source.finish()
            assert len(source._tokens) == 1 and source.cached() == len(seq)
            source.propose(seq[-1], len(seq), 2, SamplingParams(), np.random.default_rng(0))  # taken: up to date
            t.decode([seq[-1]], len(seq))
            seq.append(seq[-1])
            source.observe(Commit(len(seq) - 1, [seq[-1]], sequence=seq))
            source.finish()
            assert not source._tokens and source.heads._live().pos_max() == len(seq) - 1
        finally:
            source.close()


# --- heads shipped apart, given where a drafter is accepted --------------------------------------------


def spy_drafts(session: Session) -> list[list[int]]:
    """The drafts the Session's heads make, recorded as the real heads make them."""
    heads, log = session._mtp.heads, []
    real = heads.draft
    heads.draft = lambda *args, **kw: log.append(real(*args, **kw)) or log[-1]
    return log


def test_heads_files_are_told_from_drafters_by_their_header(mtp_target, hybrid_models, gemma4, tmp_path):
    from dflash_gguf.mtp import is_heads_file

    renamed = tmp_path / "drafter.gguf"  # the name says nothing: the header does
    renamed.write_bytes((mtp_target.parent / "mtp-qwen35.gguf").read_bytes())
    assert is_heads_file(renamed) and is_heads_file(mtp_target) and is_heads_file(gemma4[1])
    assert not is_heads_file(hybrid_models.drafter("qwen35"))  # a dflash drafter
    assert not is_heads_file(hybrid_models.target("qwen35"))  # a model without heads
    assert not is_heads_file(mtp_target.parent / "qwen35-mtp-hf" / "config.json")


@pytest.mark.parametrize("block", [3, None])
def test_a_session_given_a_heads_file_drafts_with_it(mtp_target, hybrid_models, block):
    """Session(trunk, drafter="mtp-qwen35.gguf"): the heads file drafts (no drafter is opened), exactly what
    the heads embedded in qwen35-mtp.gguf draft there, cycle for cycle, and greedy output is plain decoding."""
    heads = mtp_target.parent / "mtp-qwen35.gguf"
    with open_session(mtp_target, lookup=False) as embedded:
        log = spy_drafts(embedded)
        want = embedded.generate("Good morning!", max_tokens=32, block_size=block)
    with open_session(hybrid_models.target("qwen35"), drafter=heads, lookup=False) as s:
        assert s.drafter is None and s.mtp and [src.name for src in s._sources] == [MTP_SOURCE]
        assert s.target.n_mtp_heads == 0  # the trunk has none: these are the file's
        plain = s.generate("Good morning!", max_tokens=32, speculative=False).tokens
        s.reset()
        got_log = spy_drafts(s)
        got = s.generate("Good morning!", max_tokens=32, block_size=block)
    assert got.tokens == plain == want.tokens
    assert got.stats.per_source[MTP_SOURCE].n_drafted > 0 and got_log == log


@pytest.mark.parametrize("sequences", [1, 2])
def test_forks_of_a_session_given_a_heads_file_share_its_weights(mtp_target, hybrid_models, sequences):
    """A fork (a context of its own, or the next sequence of a shared one, as dflash-serve's slots) drafts with
    the same loaded heads and replies the same; the file's weights are freed with the last user."""
    heads = mtp_target.parent / "mtp-qwen35.gguf"
    with open_session(hybrid_models.target("qwen35"), drafter=heads, lookup=False, sequences=sequences) as s:
        want = s.generate("Good morning!", max_tokens=16, block_size=3)
        with s.fork() as other:
            assert other._mtp.heads._ctx.model is s._mtp.heads._ctx.model  # one load of the file
            log = spy_drafts(other)
            r = other.generate("Good morning!", max_tokens=16, block_size=3)
            assert r.tokens == want.tokens and len(log) == r.stats.per_source[MTP_SOURCE].cycles > 0
        model = s._speculation.heads.model
        assert model.users == 2  # the Session's share and its MTP context's: the fork gave its own back
    assert model.users == 0


def test_the_shared_memory_assistant_drafts_in_a_session(gemma4):
    """gemma4's assistant, given as the drafter, drafts in a Session; greedy output is plain decoding."""
    target, assistant = gemma4
    with Session(target, assistant, n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, lookup=False) as s:
        assert s.mtp and s._mtp.heads.mem_shared
        want = s.generate("Good morning!", max_tokens=24, speculative=False).tokens
        s.reset()
        r = s.generate("Good morning!", max_tokens=24, block_size=3)
    assert r.tokens == want and r.stats.per_source[MTP_SOURCE].n_drafted > 0


def test_a_prompt_cache_entry_names_the_heads_file_that_drafted(mtp_target, tmp_path):
    """The entry holds the heads' KV: a Session drafting with a heads file reads only entries made with it,
    not those of the target's own heads (same target file, same source names)."""
    from dflash_gguf.prompt_cache import PromptCache

    cache = PromptCache(ram_bytes=1 << 24, directory=tmp_path)
    with open_session(mtp_target, prompt_cache=cache) as own, \
            open_session(mtp_target, drafter=mtp_target.parent / "mtp-qwen35.gguf", prompt_cache=cache) as apart:
        assert [s.name for s in own._sources] == [s.name for s in apart._sources]
        assert own._cache_link.context_id() != apart._cache_link.context_id()


def test_a_heads_file_for_another_target_is_refused(mtp_target, embedded_target, capsys):
    from dflash_gguf.cli import main

    heads = mtp_target.parent / "mtp-qwen35.gguf"
    with pytest.raises(ValueError, match="not MTP heads for this target: it is a qwen35, the target a llama"):
        Session(embedded_target, heads, n_ctx=N_CTX, n_threads=1)
    with pytest.raises(ValueError, match="holds MTP heads, and MTP drafting is off"):
        open_session(mtp_target, drafter=heads, mtp=False)
    assert main(["hi", "--target", str(embedded_target), "--drafter", str(heads), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not MTP heads for this target" in err


def test_a_head_set_aside_offers_again_after_quiet_spells_that_double(mtp_target):
    """Declined SET_ASIDE_AFTER times in a row, the head offers nothing for QUIET_CYCLES commits (the policy
    does not price it), then offers once; declined again, it is quiet twice as long (up to QUIET_MAX); a
    draft taken ends the back-off. Its rows are kept all along: the draft after is exact."""
    from dflash_gguf.mtp import QUIET_CYCLES, QUIET_MAX, SET_ASIDE_AFTER

    with Target.open(mtp_target, n_ctx=2048, n_batch=N_BATCH, n_threads=1, n_rs_seq=N_RS_SEQ, load_mtp=True) as t:
        source = MTPSource(t)
        try:
            seq = list(PROMPTS[0])
            t.decode(seq, 0)
            source.observe(Commit(0, list(seq), sequence=seq))

            def cycle(offer: bool) -> None:
                if offer:
                    source.offer(seq[-1], len(seq), 3)
                t.decode([seq[-1]], len(seq))
                seq.append(seq[-1])
                source.observe(Commit(len(seq) - 1, [seq[-1]], sequence=seq))

            for _ in range(SET_ASIDE_AFTER):
                assert source.available(seq[-1], len(seq)) == 3
                cycle(True)
            quiet = []
            for spell in range(4):
                n = 0
                while not source.available(seq[-1], len(seq)):
                    cycle(False)
                    n += 1
                quiet.append(n)
                cycle(True)  # offered once, declined again
            assert quiet == [QUIET_CYCLES, 2 * QUIET_CYCLES, 4 * QUIET_CYCLES, min(8 * QUIET_CYCLES, QUIET_MAX)]
            while not source.available(seq[-1], len(seq)):
                cycle(False)
            assert source._tokens and len(source._tokens) == len(seq) - source._n  # every row kept, waiting
            source.offer(seq[-1], len(seq), 3)
            assert len(source.propose(seq[-1], len(seq), 3, SamplingParams(), np.random.default_rng(0)).tokens) == 3
            cycle(False)
            assert source.available(seq[-1], len(seq)) == 3 and source._quiet_next == QUIET_CYCLES
        finally:
            source.close()


def test_the_mtp_setting_turns_the_heads_off(mtp_target):
    with open_session(mtp_target, mtp=False) as s:
        assert not s.mtp and s.target.n_mtp_heads == 0
        assert [src.name for src in s._sources] == ["lookup"]


def test_the_doctor_names_the_sources_a_target_has(mtp_target, hybrid_models, step35, capsys):
    """Which sources a pair has, and of the MTP heads how many, how driven (chained) and whose."""
    import json

    from dflash_gguf.doctor import main

    common = ["--n-ctx", "512", "--threads", "1"]
    assert main(["--target", str(mtp_target), *common]) == 0
    text = capsys.readouterr().out
    assert "sources    lookup, mtp\n" in text and "the target's own MTP heads draft" in text
    assert "mtp        1 head, chained on its own output, at most 3 drafts a cycle; the target's own\n" in text
    assert main(["--target", str(step35[3]), *common]) == 0
    assert "mtp        3 chained heads (head i drafts token i + 1), at most 3 drafts a cycle" in capsys.readouterr().out
    trunk = str(hybrid_models.target("qwen35"))
    assert main(["--target", trunk, *common, "--json"]) == 0
    pair = json.loads(capsys.readouterr().out)["pair"]
    assert pair["sources"] == ["lookup"] and pair["mtp"] is None
    heads = str(mtp_target.parent / "mtp-qwen35.gguf")
    assert main(["--target", trunk, "--drafter", heads, *common, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pair"]["sources"] == ["lookup", "mtp"] and report["pair"]["drafter"] is None
    assert report["pair"]["mtp"] == {"heads": 1, "layout": "one", "max_draft": 3, "file": heads}
    assert any("the MTP heads given as --drafter draft" in line for line in report["advice"])


def test_dflash_bench_runs_an_mtp_mode_beside_dflash(mtp_target, hybrid_models, tmp_path, capsys):
    """--modes mtp: the heads alone on their own Session; plain and dflash never load them (so dflash is the
    drafter alone), and a target without heads is one line and exit 2."""
    import json

    from dflash_gguf.bench.cli import main

    prompts = tmp_path / "one.jsonl"
    prompts.write_text(json.dumps({"id": "sea", "category": "chat", "prompt": "Say something about the sea."}) + "\n")
    common = ["--prompts", str(prompts), "--drafter", str(hybrid_models.drafter("qwen35")), "--max-tokens", "12",
              "--repeats", "1", "--no-warmup", "--threads", "1", "--block-size", "3", "--n-ctx", "512"]
    out = tmp_path / "results"
    rc = main(["--target", str(mtp_target), *common, "--modes", "dflash", "mtp", "--out", str(out), "--name", "mtp"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    data = json.loads((out / "mtp.json").read_text())
    assert data["settings"]["modes"] == ["plain", "dflash", "mtp"]
    modes = data["summary"]["all"]["modes"]
    assert set(modes["mtp"]["per_source"]) == {MTP_SOURCE} and modes["mtp"]["per_source"][MTP_SOURCE]["n_drafted"] > 0
    assert MTP_SOURCE not in modes["dflash"]["per_source"]
    assert "mtp median" in stdout
    rc = main(["--target", str(hybrid_models.target("qwen35")), *common, "--modes", "mtp", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "mode mtp: the target has no MTP heads" in err
    heads = mtp_target.parent / "mtp-qwen35.gguf"
    rc = main(["--target", str(hybrid_models.target("qwen35")), *common[:2], "--drafter", str(heads), *common[4:],
               "--modes", "mtp", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "holds MTP heads: dflash-bench times a DFlash" in err

"""Batching across slots (issue 37): Sessions that are sequences of one target context decode together.

The real embedded target and its shipped drafter. What is asserted: replies of generations running at once
are token for token what each prompt gets alone on a cold context (greedy, plain and speculative), their
decodes really were shared, a sequence's memory is its own, the shared context's refusals, the batch pricing
with a cost curve that climbs (this CPU's) and one that is flat (a GPU's), and a server whose slots share one
context answering concurrent requests as it answers them one at a time.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from llama_cpp import llama_cpp

from dflash_gguf import Session, SessionOptions
from dflash_gguf.batching import SequenceTarget, SharedContext, Stage
from dflash_gguf.config import SettingError
from dflash_gguf.controller import AdaptivePolicy, CostModel
from dflash_gguf.server import ServerConfig, create_app
from dflash_gguf.speculation import BatchPricedCosts
from dflash_gguf.target import quantize
from dflash_gguf.sources import Offer

from test_server import running

PROMPTS = ["What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
           "Write one sentence about the sea."]
N = 24  # tokens per reply


def ask(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def alone():
    """Each prompt on a context of its own, cold: the replies batching must reproduce."""
    s = Session(n_ctx=1024)
    out = {}
    for speculative in (False, True):
        for p in PROMPTS:
            out[p, speculative] = s.chat(ask(p), max_tokens=N, temperature=0, speculative=speculative).tokens
            s.reset()
    s.close()
    return out


@pytest.fixture(scope="module")
def shared():
    """Four Sessions, sequences 0..3 of one context; batches wait for every busy sequence (no timeout race)."""
    first = Session(n_ctx=1024, sequences=len(PROMPTS))
    first.target.shared.max_wait_s = 60.0
    sessions = [first] + [first.fork() for _ in PROMPTS[1:]]
    yield sessions
    for s in sessions:
        s.close()


def at_once(sessions, prompts, **settings):
    """Every prompt on its own Session, all started together; the replies' tokens in prompt order."""
    start = threading.Barrier(len(prompts))

    def one(pair):
        s, p = pair
        start.wait()
        return s.chat(ask(p), max_tokens=N, temperature=0, **settings).tokens

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, zip(sessions, prompts)))


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_replies_at_once_are_the_replies_alone(shared, alone, speculative):
    for s in shared:
        s.reset()
    context = shared[0].target.shared
    before = context.shared_batches
    replies = at_once(shared, PROMPTS, speculative=speculative)
    assert replies == [alone[p, speculative] for p in PROMPTS]
    assert context.shared_batches > before  # the decodes really went out together
    # a follow-up turn on every sequence reuses its own cached prefix, untouched by the others' decodes
    follow = [shared[i].committed_tokens[:] for i in range(len(PROMPTS))]
    again = at_once(shared, PROMPTS, speculative=speculative)
    assert again == replies
    assert all(s.last_stats.n_cached_tokens > 0 for s in shared)
    assert [shared[i].committed_tokens[: len(follow[i])] for i in range(len(PROMPTS))] == follow


@pytest.mark.slow  # 17 s: the fast tier keeps under 5 minutes
def test_the_drafter_drafts_for_every_sequence_in_one_pass(shared, alone):
    """Fixed blocks (every cycle drafts, whatever the batch pricing says): the sequences' blocks and feature
    injections go out together, and each sequence's drafts are what it drafts alone: the same replies and the
    same accepted drafts, cycle for cycle."""
    solo = Session(n_ctx=1024)
    expected = {}
    for p in PROMPTS:
        r = solo.chat(ask(p), max_tokens=N, temperature=0, block_size=4)
        expected[p] = (r.tokens, r.stats.n_drafted, r.stats.n_accepted)
        solo.reset()
    solo.close()
    for s in shared:
        s.reset()
    context = shared[0].target.shared
    before = dict(context.shared_passes)
    start = threading.Barrier(len(PROMPTS))

    def one(pair):
        s, p = pair
        start.wait()
        r = s.chat(ask(p), max_tokens=N, temperature=0, block_size=4)
        return r.tokens, r.stats.n_drafted, r.stats.n_accepted

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, zip(shared, PROMPTS)))
    assert got == [expected[p] for p in PROMPTS]
    assert sum(n_accepted for _, _, n_accepted in got) > 0  # the drafts are worth something: real features reached them
    assert context.shared_passes[Stage.DRAFT] > before[Stage.DRAFT]
    assert context.shared_passes[Stage.INJECT] > before[Stage.INJECT]


def test_sequences_are_handed_out_and_given_back():
    first = Session(n_ctx=256, sequences=2, lookup=False, drafter=None)
    try:
        assert isinstance(first.target, SequenceTarget) and first.target.seq_id == 0
        second = first.fork()
        assert second.target.seq_id == 1 and second.target.shared is first.target.shared
        with pytest.raises(RuntimeError, match="all 2 sequences of the shared context are in use"):
            first.fork()
        reply = second.generate("Once upon a time", max_tokens=4, temperature=0, speculative=False).tokens
        held = second.target.pos_max(0)
        assert held >= 0 and first.target.pos_max(0) == -1  # one sequence's cells are not the other's
        second.close()
        third = first.fork()  # the freed id, with none of the closed sequence's cells
        assert third.target.seq_id == 1 and third.target.pos_max(0) == -1
        assert third.generate("Once upon a time", max_tokens=4, temperature=0, speculative=False).tokens == reply
        with pytest.raises(ValueError, match="sequence 0 to its callers"):
            third.target.remove(1, 0)
        with pytest.raises(ValueError, match="no other sequence"):
            third.target.copy_sequence(0, 0)
        third.close()
    finally:
        first.close()
    assert first.target.shared.owner.closed  # the context went with its last sequence


def test_settings_refused():
    with pytest.raises(SettingError, match="sequences"):
        SessionOptions(sequences=0)
    with pytest.raises(SettingError, match="tree_nodes"):
        SessionOptions(sequences=2, tree_nodes=8)
    with pytest.raises(SettingError, match="at most"):
        SessionOptions(sequences=100_000)


def test_a_shared_context_needs_its_own_streams(embedded_target):
    from dflash_gguf.target import Target

    with Target.open(embedded_target, n_ctx=512, n_seq_max=2, kv_unified=True) as unified:
        with pytest.raises(ValueError, match="one KV stream per sequence"):
            SharedContext(unified)


def test_a_batch_waits_for_a_generation_between_two_of_its_cycles(embedded_target):
    """A sequence that decoded in the cycle it just left is expected back (its thread is handing a Step to
    its consumer): the next batch waits for its rows rather than going without them, which would cost an
    extra decode; a cycle that decoded nothing arms nothing, and one that does not come back within linger_s
    is not waited for."""
    from dflash_gguf.target import Target

    owner = Target.open(embedded_target, n_ctx=512, n_seq_max=2, kv_unified=False)
    context = SharedContext(owner, linger_s=60.0)
    a, b = context.sequence(), context.sequence()
    try:
        with a.cycle():
            a.decode([1, 2, 3], 0)
        assert context.busy == 1  # between two cycles, it still counts as decoding (the batch pricing's k)
        before = context.batches
        done = threading.Event()

        def b_cycle(tokens, pos):
            with b.cycle():
                b.decode(tokens, pos)
            done.set()

        other = threading.Thread(target=b_cycle, args=([1, 2, 3], 0))
        other.start()
        assert not done.wait(1.0)  # b's rows wait for a's
        with a.cycle():
            a.decode([4], 3)
        other.join(60)
        assert done.is_set() and context.batches == before + 1 and context.last.sequences == 2
        with a.cycle():  # the empty cycle a generation's consumer runs after its last Step
            pass
        done.clear()
        other = threading.Thread(target=b_cycle, args=([4], 3))
        other.start()
        other.join(60)
        assert done.is_set() and context.last.sequences == 1  # nobody was expected: b went at once
        alone = threading.Thread(target=b.decode, args=([5], 4))  # b, expected, decodes outside a cycle
        alone.start()
        alone.join(30)
        assert not alone.is_alive()  # it does not wait for itself
        context.linger_s = 0.05
        with a.cycle():
            a.decode([5], 4)
        done.clear()
        b_cycle([6], 5)  # a never comes back: b's rows go without it once its linger has run out
        assert context.last.sequences == 1
    finally:
        for v in (a, b):
            v.close()


def test_a_gap_between_busy_sequences_is_filled_and_leaves_no_trace(embedded_target):
    """libllama cuts a batch of sequences 0 and 2 into two passes; a filler row for sequence 1 joins them into
    one. Each sequence's logits are still bit for bit what a context of its own gives, and sequence 1 holds
    exactly what it held (its next row too is what it is alone). A gap that costs more rows than the pass it
    saves (by the shared context's own fit of its batches) stays open."""
    import numpy as np

    from dflash_gguf.target import Target

    prompts = [[1, 22, 333, 4444], [5, 66, 777, 888, 99], [10, 11, 12]]
    nxt = [[50], [51], [52]]

    def alone(i: int) -> tuple[np.ndarray, np.ndarray]:
        with Target.open(embedded_target, n_ctx=512) as t:
            t.decode(prompts[i], 0)
            t.decode(nxt[i], len(prompts[i]), logits=True)
            first = np.array(t.output_logits()[-1])
            t.decode([60], len(prompts[i]) + 1, logits=True)
            return first, np.array(t.output_logits()[-1])

    owner = Target.open(embedded_target, n_ctx=3 * 512, n_seq_max=3, kv_unified=False)
    context = SharedContext(owner, max_wait_s=60.0)
    views = [context.sequence() for _ in prompts]
    memory = llama_cpp.llama_get_memory(owner.ctx)
    try:
        for v, p in zip(views, prompts):
            v.decode(p, 0)
        start = threading.Barrier(2)
        got = {}

        def step(i: int) -> None:
            with views[i].cycle():
                start.wait()
                views[i].decode(nxt[i], len(prompts[i]), logits=True)
                got[i] = np.array(views[i].output_logits()[-1])
            views[i].remove(0, len(prompts[i]), -1)  # back to its prompt, for the next round

        threads = [threading.Thread(target=step, args=(i,)) for i in (0, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(got) == [0, 2] and context.last.sequences == 2 and context.filler_rows == 1  # 0, [1], 2: one pass
        assert llama_cpp.llama_memory_seq_pos_max(memory, 1) == len(prompts[1]) - 1  # the filler is gone
        for i in (0, 2):
            assert np.array_equal(got[i], alone(i)[0]), i
        views[1].decode(nxt[1], len(prompts[1]), logits=True)
        views[1].decode([60], len(prompts[1]) + 1, logits=True)
        assert np.array_equal(np.array(views[1].output_logits()[-1]), alone(1)[1])

        context.passes._xx, context.passes._xy = np.eye(2), np.array([0.001, 0.01])  # a row dearer than a pass
        assert not context.passes.fill_pays(1)
        filled = context.filler_rows
        got.clear()
        for t in (threads := [threading.Thread(target=step, args=(i,)) for i in (0, 2)]):
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(got) == [0, 2] and context.last.sequences == 2 and context.filler_rows == filled  # two passes
    finally:
        for v in views:
            v.close()


def test_a_request_takes_a_slot_next_to_the_busy_sequences(shared):
    """libllama decodes a batch of a shared context in one pass per run of consecutive sequence ids: a request
    with no home takes a free slot next to the busy ones, a gap first, where the least recently used slot
    would scatter them; a slot that is a request's home is still its own."""
    import asyncio

    from dflash_gguf.server.slots import SlotPool

    async def go() -> None:
        pool = SlotPool(shared, max_queue=4)
        prompt = [7, 7, 7]  # a prefix no slot holds: no home, every cached prefix ties
        taken = [await pool.acquire(prompt) for _ in range(3)]
        assert [s.id for s in taken] == [0, 1, 2]
        pool.release(taken[1])  # busy: 0 and 2; slot 3 is the least recently used, slot 1 fills the gap
        assert (await pool.acquire(prompt)).id == 1
        pool.release(taken[2])  # busy: 0 and 1; free: 2, next to them, and 3, which holds a conversation
        conversation = list(range(100, 140))
        pool.slots[3].prompt = conversation
        assert (await pool.acquire(conversation + [5])).id == 3

    for s in shared:
        s.reset()
    asyncio.run(go())


def _offers(p: float, n: int) -> list[Offer]:
    """One source whose every draft commits with probability p after the one before it did."""
    return [Offer("toy", n, [sum(p ** i for i in range(m + 1)) for m in range(n + 1)])]


@pytest.mark.parametrize("curve, k, drafts", [
    ({1: 1.0, 16: 11.5}, 1, True),    # this CPU (Q4_1, one thread), alone: 16 rows for 11.5 steps
    ({1: 1.0, 16: 11.5}, 4, False),   # the same curve, four sequences decoding: plain steps
    ({1: 1.0, 16: 1.1, 128: 2.0}, 4, True),  # a flat curve (a GPU's): still worth drafting
])
def test_blocks_are_priced_by_their_share_of_the_batch(embedded_target, curve, k, drafts):
    """A toy source whose drafts commit with probability 0.8 each: a short block pays alone on the CPU curve,
    no block does when four sequences decode (their rows cost four times over), and on a flat curve long
    blocks still do at four."""
    from dflash_gguf.target import Target

    owner = Target.open(embedded_target, n_ctx=256 * k if k > 1 else 512, n_seq_max=max(2, k), kv_unified=False)
    context = SharedContext(owner)
    views = [context.sequence() for _ in range(max(2, k))]
    try:
        costs = BatchPricedCosts(CostModel({n: s / 100 for n, s in curve.items()}, {16: 1e-4}), context)
        for v in views[:k]:
            context.enter(v.seq_id)
        choice = AdaptivePolicy(costs).choose(_offers(0.8, 15))
        assert (choice.n_draft > 0) is drafts, choice.reason
    finally:
        for v in views:
            v.close()


def test_a_server_on_one_shared_context(shared, alone):
    """Two slots of one context behind the real app: concurrent requests get the replies they get alone."""
    for s in shared:
        s.reset()
    with running(create_app(shared[:2], ServerConfig(model_alias="smol"))) as (url, _):
        def post(p):
            r = httpx.post(url + "/v1/chat/completions", timeout=300,
                           json={"messages": ask(p), "max_tokens": N, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(post, PROMPTS[:2]))
        metrics = httpx.get(url + "/metrics").text
    context = shared[0].target.shared
    assert f"dflash_batches_total {context.batches}" in metrics
    assert f"dflash_batches_shared_total {context.shared_batches}" in metrics
    ref = Session(n_ctx=1024)
    try:
        for p, text in zip(PROMPTS[:2], texts):
            assert text == ref.chat(ask(p), max_tokens=N, temperature=0).text
            ref.reset()
    finally:
        ref.close()


@pytest.mark.slow  # builds the hybrid fixtures
@pytest.mark.parametrize("arch, rollback", [("lfm2", "snapshot"), ("qwen3next", "checkpoint")])
def test_recurrent_targets_share_a_context_and_reply_as_alone(hybrid_models, tmp_path, arch, rollback):
    """A hybrid target's sequences share one context like a transformer's: each rolls back its own recurrent
    state (lfm2 by libllama's per-sequence snapshots, qwen3next by checkpoints saved and restored through its
    sequence's id), and speculative replies at once are token for token the replies alone. The fixture is
    quantized to Q4_1 as users' targets are: the f16 fixture's matmuls give a row slightly other results when
    another sequence's row shares its micro-batch (docs/DESIGN.md)."""
    target = tmp_path / f"{arch}-q4_1.gguf"
    quantize(hybrid_models.target(arch), target, llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_1)
    drafter = hybrid_models.drafter(arch)
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
    settings = dict(max_tokens=16, temperature=0, block_size=4)  # every cycle drafts, so rollbacks happen
    with Session(target, drafter=drafter, lookup=False, n_ctx=256) as solo:
        expected = []
        for p in prompts:
            expected.append(solo.generate(p, **settings).tokens)
            solo.reset()
    first = Session(target, drafter=drafter, lookup=False, n_ctx=256, sequences=len(prompts))
    sessions = [first] + [first.fork() for _ in prompts[1:]]
    try:
        assert isinstance(first.target, SequenceTarget)
        first.target.shared.max_wait_s = 60.0
        start = threading.Barrier(len(prompts))

        def one(pair):
            s, p = pair
            start.wait()
            return s.generate(p, **settings).tokens

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(one, zip(sessions, prompts))) == expected
        assert first.target.shared.shared_batches > 0
        assert all(s.memory.rollbacks[rollback] > 0 for s in sessions)
    finally:
        for s in sessions:
            s.close()


def test_the_prompt_cache_serves_every_sequence(tmp_path):
    """One sequence's stored state restores into another sequence of the same context (a slot's conversation
    resumed on another slot), target and drafter parts both, and the reply is the cold one (fixed blocks:
    every cycle drafts, so the drafter's restored cells are used)."""
    from dflash_gguf.prompt_cache import PromptCache

    cache = PromptCache(ram_bytes=1 << 30)
    prompt = "The quick brown fox jumps over the lazy dog. " * 6 + "Continue the story:"
    with Session(n_ctx=1024, sequences=2, prompt_cache=cache) as first:
        cold = first.generate(prompt, max_tokens=16, temperature=0, block_size=4)
        assert cold.stats.prompt_cache.stored and cold.stats.prompt_cache.tier is None
        with first.fork() as second:
            warm = second.generate(prompt, max_tokens=16, temperature=0, block_size=4)
    assert warm.stats.prompt_cache.tier == "ram" and warm.stats.prompt_cache.n_restored > 0
    assert warm.tokens == cold.tokens and warm.stats.n_drafted > 0

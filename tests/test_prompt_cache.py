"""The prompt cache (issue 23): a restored prefix decodes exactly as a cold prefill, from RAM and from disk;
LRU eviction and budgets; a corrupt, truncated, foreign or half-written file is a miss with a warning.

The Session tests run the embedded pair (real libllama, the shipped drafter); the cache-mechanics tests
store real libllama sequence states of the embedded target.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest

from dflash_gguf import Session, Target
from dflash_gguf.prompt_cache import SUFFIX, TEMP_MARK, PromptCache, Snapshot, context_id, entry_name, parse_size

AGENT = (
    "You are a coding agent. You can call tools: read_file(path), write_file(path, text), run(cmd). "
    "Answer briefly. Here is the file you read:\n\n"
    + "def add(a, b):\n    return a + b\n\n" * 12
    + "Question: what does add do?"
)


@pytest.fixture(scope="module")
def states(embedded_target):
    """Real target states (llama_state_seq bytes) of the embedded target after 8, 16, ... 64 tokens."""
    with Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as t:
        tokens = t.vocab.tokenize(AGENT)[:64]
        out = {}
        for n in (8, 16, 32, 64):
            t.remove(0, 0)
            t.decode(tokens[:n], 0, logits=False)
            out[n] = Snapshot(tuple(tokens[:n]), {"target": t.save_sequence()})
        return out


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("0") == 0
    assert parse_size("1.5GB") == 1_500_000_000 and parse_size("4k") == 4000
    for bad in ("", "2 GiBs", "-1", "GiB", "1e9"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_longest_prefix_wins_and_the_last_prompt_token_is_left_to_decode(states):
    cache = PromptCache(ram_bytes=1 << 30)
    ctx = context_id({"test": 1})
    for n in (8, 32):
        cache.store(ctx, states[n], supersede=False)
    prompt = list(states[64].tokens)
    hit = cache.lookup(ctx, prompt)
    assert hit.tier == "ram" and hit.n_usable == 32 and hit.snapshot is states[32]
    assert cache.lookup(ctx, prompt, at_least=32) is None  # the live context already holds as much
    assert cache.lookup(ctx, prompt[:32]).n_usable == 31  # an identical prompt re-decodes its last token
    assert cache.lookup(ctx, prompt[:32], prefix_only=True).n_usable == 8  # hybrid: entries the prompt extends
    assert cache.lookup(context_id({"test": 2}), prompt) is None  # another context's entries are never candidates
    assert cache.counters.hits["ram"] == 3 and cache.counters.misses == 2


def test_ram_tier_evicts_least_recently_used(states):
    size = states[8].nbytes + states[16].nbytes + 1
    cache = PromptCache(ram_bytes=size)
    ctx = context_id({"test": 1})
    cache.store(ctx, states[8], supersede=False)
    cache.store(ctx, states[16], supersede=False)
    assert cache.entries["ram"] == 2
    cache.lookup(ctx, list(states[8].tokens) + [1])  # 8 is now the most recently used
    small = Snapshot(states[8].tokens[:4], {"target": states[8].parts["target"]})  # a third entry: one must go
    cache.store(ctx, small, supersede=False)
    assert cache.ram_used <= size and cache.counters.evictions["ram"] == 1
    assert cache.lookup(ctx, list(states[16].tokens) + [1]).snapshot is states[8]  # 16 was evicted, not 8
    assert not cache.store(ctx, states[64]) or states[64].nbytes <= size  # larger than the budget: not kept


def stored(cache: PromptCache, *args, **kwargs) -> PromptCache:
    """The cache after a store whose disk write has finished (the writer thread does it after store returns)."""
    cache.store(*args, **kwargs)
    assert cache.flush()
    return cache


def test_a_store_returns_before_its_disk_write_and_serves_it_meanwhile(states, tmp_path):
    """The writer thread writes a disk entry after store() returns (a reply need not wait for the checksum and
    the write); until the file is in place, a lookup is served from the bytes the writer holds. A FIFO at the
    writer's temp name holds the write open while the test looks."""
    ctx = context_id({"test": 1})
    cache = PromptCache(directory=tmp_path)  # no RAM tier: only the writer holds the bytes
    name = entry_name(ctx, states[16].tokens)
    fifo = tmp_path / f"{name}{TEMP_MARK}{os.getpid()}"
    os.mkfifo(fifo)
    queued = cache.store(ctx, states[16])  # returns: the writer is blocked opening the FIFO, no reader yet
    try:
        assert queued
        hit = cache.lookup(ctx, list(states[16].tokens) + [5])
        assert hit.tier == "disk" and hit.snapshot is states[16] and cache.entries == {"ram": 0, "disk": 1}
        assert not (tmp_path / name).exists()
    finally:
        if queued:  # let the writer through (after a failure above too): what it writes is the entry
            with open(fifo, "rb") as f:
                written = f.read()
    assert cache.flush()
    (tmp_path / name).unlink()  # the FIFO, renamed into place
    stored(PromptCache(directory=tmp_path), ctx, states[16])  # the same entry as a real file, read back
    body = states[16].nbytes  # the tokens and the state, after the header (whose JSON holds the time)
    assert (tmp_path / name).read_bytes()[-body:] == written[-body:] and written[:4] == b"DFPC"
    assert PromptCache(directory=tmp_path).lookup(ctx, list(states[16].tokens) + [5]).snapshot == states[16]


def test_supersede_drops_the_prefixes_of_a_longer_entry(states, tmp_path):
    cache = PromptCache(ram_bytes=1 << 30, directory=tmp_path)
    ctx = context_id({"test": 1})
    cache.store(ctx, states[8])
    cache.store(ctx, states[32])
    assert cache.entries == {"ram": 1, "disk": 1}


def test_disk_never_exceeds_its_budget_and_evicts_the_oldest(states, tmp_path):
    ctx = context_id({"test": 1})
    one = PromptCache(directory=tmp_path, disk_bytes=1 << 30)
    one.store(ctx, states[8], supersede=False)
    one.flush()
    entry = next(tmp_path.glob(f"*{SUFFIX}")).stat().st_size
    budget = int(entry * 2.5)  # two 8-token entries fit, not three
    cache = PromptCache(directory=tmp_path, disk_bytes=budget)
    variants = [Snapshot(states[8].tokens[:-1] + (t,), states[8].parts) for t in (101, 102, 103, 104)]
    for v in variants:
        cache.store(ctx, v, supersede=False)
        cache.flush()
        used = sum(p.stat().st_size for p in tmp_path.glob(f"*{SUFFIX}"))
        assert used <= budget and cache.disk_used == used
    assert cache.counters.evictions["disk"] >= 2
    fresh = PromptCache(directory=tmp_path, disk_bytes=budget)  # a restart sees the two newest
    assert fresh.lookup(ctx, list(variants[-1].tokens) + [7]).snapshot.tokens == variants[-1].tokens
    assert fresh.lookup(ctx, list(variants[0].tokens) + [7], at_least=7) is None


def test_disk_eviction_is_least_recently_used_across_a_restart(states, tmp_path):
    """A read refreshes an entry: the one written earlier but read since outlives a newer one left unread,
    in the process that read it and in a restarted one (the order is the files' mtime)."""
    ctx = context_id({"test": 1})
    a, b, c = (Snapshot(states[8].tokens[:-1] + (t,), states[8].parts) for t in (301, 302, 303))
    stored(PromptCache(directory=tmp_path), ctx, a, supersede=False)
    entry = next(tmp_path.glob(f"*{SUFFIX}")).stat().st_size
    cache = PromptCache(directory=tmp_path, disk_bytes=int(entry * 2.5))
    stored(cache, ctx, b, supersede=False)
    assert cache.lookup(ctx, list(a.tokens) + [1]).tier == "disk"  # no RAM tier: a read from disk
    stored(cache, ctx, c, supersede=False)  # one of a, b must go: b, the least recently used
    assert cache.counters.evictions["disk"] == 1
    restarted = PromptCache(directory=tmp_path, disk_bytes=int(entry * 2.5))
    assert restarted.lookup(ctx, list(b.tokens) + [1], at_least=7) is None
    for kept in (a, c):
        assert restarted.lookup(ctx, list(kept.tokens) + [1]).snapshot.tokens == kept.tokens
    restarted.lookup(ctx, list(c.tokens) + [1])  # now a is the least recently used
    stored(restarted, ctx, b, supersede=False)
    assert restarted.lookup(ctx, list(a.tokens) + [1], at_least=7) is None
    for kept in (b, c):
        assert restarted.lookup(ctx, list(kept.tokens) + [1]).snapshot.tokens == kept.tokens


def test_a_bad_file_is_a_miss_with_a_warning(states, tmp_path, caplog):
    ctx = context_id({"test": 1})
    stored(PromptCache(directory=tmp_path), ctx, states[16])
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    good = path.read_bytes()
    prompt = list(states[16].tokens) + [5]
    cases = {
        "checksum mismatch": good[:-100] + bytes(b ^ 0xFF for b in good[-100:]),  # same size, payload flipped
        "header describes": good[: len(good) // 2],  # truncated
        "not a dflash prompt-cache file": b"GGSQ" + os.urandom(4096),  # foreign: another program's state file
        "unreadable header": good[:8] + b"\xff" * (len(good) - 8),
    }
    for problem, data in cases.items():
        path.write_bytes(data)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dflash_gguf.prompt_cache"):
            cache = PromptCache(directory=tmp_path)
            assert cache.lookup(ctx, prompt) is None, problem
        assert any(problem in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records), problem
    # a valid entry renamed to another context's name is refused too
    path.unlink()
    (tmp_path / ("0" * 16 + "-renamed" + SUFFIX)).write_bytes(good)
    with caplog.at_level(logging.WARNING, logger="dflash_gguf.prompt_cache"):
        assert PromptCache(directory=tmp_path).lookup(ctx, prompt) is None
    assert "another context" in caplog.text


def test_a_file_corrupted_after_indexing_is_caught_on_load(states, tmp_path, caplog):
    ctx = context_id({"test": 1})
    cache = stored(PromptCache(directory=tmp_path), ctx, states[16])
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="dflash_gguf.prompt_cache"):
        assert cache.lookup(ctx, list(states[16].tokens) + [5]) is None
    assert "checksum mismatch" in caplog.text and cache.counters.rejected_files == 1


def test_a_killed_writers_temp_file_is_ignored_and_removed(states, tmp_path):
    ctx = context_id({"test": 1})
    stored(PromptCache(directory=tmp_path), ctx, states[16])
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    partial = tmp_path / f"{path.name}{TEMP_MARK}{int(dead.stdout)}"
    partial.write_bytes(path.read_bytes()[:1000])  # what a writer killed mid-write leaves behind
    path.unlink()
    cache = PromptCache(directory=tmp_path)
    assert cache.lookup(ctx, list(states[16].tokens) + [5]) is None and cache.entries["disk"] == 0
    assert not partial.exists()
    live = tmp_path / f"{path.name}{TEMP_MARK}{os.getppid()}"  # a live writer's temp file is left alone
    live.write_bytes(b"partial")
    PromptCache(directory=tmp_path)
    assert live.exists()


def test_concurrent_readers_never_see_a_half_written_entry(states, tmp_path):
    ctx = context_id({"test": 1})
    writer = PromptCache(directory=tmp_path, disk_bytes=1 << 30)
    variants = [Snapshot(states[64].tokens[:-1] + (t,), states[64].parts) for t in range(200, 230)]
    written = {v.tokens: v for v in variants}
    done = threading.Event()
    bad: list[str] = []

    def read() -> None:
        reader = PromptCache(directory=tmp_path, disk_bytes=1 << 30)  # another process's view of the directory
        while not done.is_set():
            for v in variants:
                hit = reader.lookup(ctx, list(v.tokens) + [1], at_least=62)
                if hit is not None and hit.snapshot != written.get(hit.snapshot.tokens):
                    bad.append(f"an entry that differs from what was written, for {v.tokens[-1]}")
            if reader.counters.rejected_files:
                bad.append("a reader saw a file that failed its checks")

    readers = [threading.Thread(target=read) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for v in variants:
            writer.store(ctx, v, supersede=False)
        assert writer.flush()  # the readers go on until every entry is on disk
    finally:
        done.set()
        for r in readers:
            r.join()
    assert not bad


# -- Sessions on the embedded pair ------------------------------------------------------------------
def run_tokens(session: Session, tokens: list[int], **gen) -> tuple[list[int], object]:
    """The reply tokens and stats of a generation from a tokenized prompt."""
    out = [t for step in session.stream_tokens(tokens, **gen) for t in step.tokens]
    return out, session.last_stats


@pytest.mark.slow  # four Sessions of the embedded pair, each calibrating its drafter
def test_a_restored_prefix_decodes_as_a_cold_prefill_from_ram_and_from_disk(tmp_path):
    """Greedy, speculative (fixed blocks: every cycle drafts): the reply after restoring the state equals the
    reply after a cold prefill."""
    kw = dict(n_ctx=1024, n_threads=1)
    cache = PromptCache(ram_bytes=1 << 30, directory=tmp_path)
    with Session(prompt_cache=cache, **kw) as first:
        cold = first.generate(AGENT, max_tokens=24, block_size=4)
        assert cold.stats.prompt_cache.tier is None and cold.stats.prompt_cache.stored
        assert cold.stats.n_cached_tokens == 0
        n_prompt = cold.stats.n_prompt_tokens
        with first.fork() as other:  # another slot: the RAM tier
            warm = other.generate(AGENT, max_tokens=24, block_size=4)
    assert warm.tokens == cold.tokens and warm.stats.n_drafted > 0
    assert warm.stats.prompt_cache.tier == "ram" and warm.stats.prompt_cache.n_restored == n_prompt - 1
    assert warm.stats.n_cached_tokens == n_prompt - 1
    with Session(prompt_cache=PromptCache(directory=tmp_path), **kw) as restarted:  # a new process's cache
        disk = restarted.generate(AGENT, max_tokens=24, block_size=4)
        assert disk.tokens == cold.tokens
        assert disk.stats.prompt_cache.tier == "disk" and disk.stats.n_cached_tokens == n_prompt - 1
        # the next turn extends the stored prompt + reply: restored whole, only the new tokens prefilled
        follow = restarted.tokenize(AGENT) + cold.tokens + restarted.tokenize("\nAnd subtract?", add_special=False)
        restarted.reset()  # forget the live context: the cache must serve it
        turn, stats = run_tokens(restarted, follow, max_tokens=16, block_size=4)
        assert stats.prompt_cache.tier in ("ram", "disk") and stats.n_cached_tokens >= n_prompt
    with Session(**kw) as plain:
        assert run_tokens(plain, follow, max_tokens=16, block_size=4)[0] == turn

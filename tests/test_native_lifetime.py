"""Native handles are never used after they are freed (issue 15): every public Target / Drafter entry
that reaches libllama raises ClosedError once its owner (or, for a drafter, its target) is closed,
close() twice is a no-op, and a loaded model shared by forks lives until its last user closes.

All on the real embedded target and the real embedded drafter: a use-after-free here would be a
segfault that kills pytest, so each case first proves the call works while open.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf import memory
from dflash_gguf.defaults import embedded_drafter
from dflash_gguf.drafter import Drafter
from dflash_gguf.sampling import SamplingParams
from dflash_gguf.target import ClosedError, Target

PROMPT = "Count to five: one, two,"

# (name, call) for every public Target method or property that reaches C
TARGET_CALLS = [
    ("decode", lambda t: t.decode([4], 3, logits=True)),
    ("logits", lambda t: t.logits(0)),
    ("output_logits", lambda t: t.output_logits()),
    ("features", lambda t: t.features(1)),
    ("remove", lambda t: t.remove(0, 0)),
    ("pos_max", lambda t: t.pos_max(0)),
    ("clear", lambda t: t.clear()),
    ("tokenize", lambda t: t.vocab.tokenize("hello")),
    ("token_bytes", lambda t: t.vocab.token_bytes(1)),
    ("special_token_text", lambda t: t.vocab.special_token_text(1)),
    ("is_eog", lambda t: t.vocab.is_eog(1)),
    ("bos_token", lambda t: t.vocab.bos_token()),
    ("eos_token", lambda t: t.vocab.eos_token()),
    ("chat_template", lambda t: t.vocab.chat_template()),
    ("meta", lambda t: t.meta("general.architecture")),
    ("fingerprint (uncached)", lambda t: (setattr(t, "_fingerprint", None), t.fingerprint())),
    ("token_embeddings", lambda t: t.token_embeddings()),
    ("capture", lambda t: t.capture([2, 9])),
    ("fork", lambda t: t.fork().close()),
    ("set_threads", lambda t: t.set_threads(1)),
    ("n_threads", lambda t: t.n_threads),
    ("model", lambda t: t.model),
    ("ctx", lambda t: t.ctx),
    ("memory.save_state", lambda t: memory.save_state(t, 0)),
]


# not called while open: save_state has no recurrent state to save on an attention-only target, and
# an uncached fingerprint reads the whole vocabulary (seconds); only their closed behaviour matters here
OPEN_SKIPPED = {"memory.save_state", "fingerprint (uncached)"}


def _open_target(path) -> Target:
    t = Target.open(path, n_ctx=256, n_batch=32, n_threads=1)
    t.capture([2, 9])
    return t


@pytest.mark.parametrize("name,call", TARGET_CALLS, ids=[n for n, _ in TARGET_CALLS])
def test_every_target_entry_raises_after_close(embedded_target, name, call):
    t = _open_target(embedded_target)
    t.decode([1, 2, 3], 0, logits=True)
    if name not in OPEN_SKIPPED:
        call(t)  # works while open
    t.close()
    assert t.closed
    with pytest.raises(ClosedError, match="Target .* is closed"):
        call(t)


def test_close_twice_and_context_manager(embedded_target):
    with _open_target(embedded_target) as t:
        t.decode(t.vocab.tokenize(PROMPT), 0)
    assert t.closed
    t.close()
    t.close()
    with pytest.raises(ClosedError):
        t.decode([1], 0)


def test_a_fork_keeps_the_shared_model_alive_after_its_parent_closes(embedded_target):
    parent = _open_target(embedded_target)
    tokens = parent.vocab.tokenize(PROMPT)
    parent.decode(tokens, 0)
    expected = parent.logits(len(tokens) - 1)
    fork = parent.fork()
    shared = parent._shared
    assert shared is fork._shared and shared.users == 2
    parent.close()
    assert shared.users == 1 and shared.ptr is not None  # the weights are still loaded
    fork.capture([2, 9])
    fork.decode(tokens, 0)  # runs on the shared model's weights
    np.testing.assert_array_equal(fork.logits(len(tokens) - 1), expected)
    assert fork.vocab.tokenize(PROMPT) == tokens and fork.vocab.token_bytes(tokens[-1])
    fork.close()
    assert shared.users == 0 and shared.ptr is None  # freed with its last user
    fork.close()
    shared.release()  # an extra release never frees twice
    assert shared.users == 0
    with pytest.raises(ClosedError):
        shared.share()


@pytest.fixture
def pair(embedded_target):
    t = Target.open(embedded_target, n_ctx=256, n_batch=32, n_threads=1)
    d = Drafter(embedded_drafter(), t)
    tokens = t.vocab.tokenize(PROMPT)
    t.decode(tokens, 0)
    d.inject(t.features(len(tokens)), 0)
    yield t, d, tokens
    d.close()
    t.close()


def _drafter_calls(t: Target, tokens: list[int]):
    feats = np.zeros((1, len(t.layers) * t.n_embd), dtype=np.float32)
    n = len(tokens)
    return [
        ("draft", lambda d: d.draft(tokens[-1], n, 3)),
        ("propose", lambda d: d.propose(tokens[-1], n, 3, SamplingParams(), np.random.default_rng(0))),
        ("inject", lambda d: d.inject(feats, n)),
        ("remove", lambda d: d.remove(n)),
        ("pos_max", lambda d: d.pos_max()),
        ("clear", lambda d: d.clear()),
        ("fork", lambda d: d.fork(t).close()),
    ]


def test_every_drafter_entry_raises_after_close(pair):
    t, d, tokens = pair
    calls = _drafter_calls(t, tokens)
    for _, call in calls:
        call(d)  # each works while open
    d.close()
    d.close()  # twice is a no-op
    assert d.closed and not t.closed
    for name, call in calls:
        with pytest.raises(ClosedError, match="Drafter .* is closed"):
            call(d)
    t.decode(tokens[:1], len(tokens))  # the target is unaffected


def test_a_drafter_whose_target_closed_raises_instead_of_reading_freed_memory(pair):
    t, d, tokens = pair
    t.close()
    for name, call in _drafter_calls(t, tokens):
        if name == "fork":
            with pytest.raises(ClosedError):
                call(d)
            continue
        with pytest.raises(ClosedError, match="target of this Drafter"):
            call(d)
    d.close()  # closing the drafter after its target is still clean


def test_drafter_fork_survives_closing_the_original(pair, embedded_target):
    t, d, tokens = pair
    t2 = t.fork()
    d2 = d.fork(t2)
    d.close()
    t2.capture(d2.layers)
    t2.decode(tokens, 0)
    d2.inject(t2.features(len(tokens)), 0)
    assert d2.draft(tokens[-1], len(tokens), 3).shape[0] == 3  # the drafter model is still loaded
    d2.close()
    t2.close()

"""Target: real libllama decoding of the embedded SmolLM2 GGUF, layer capture and input validation."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.defaults import embedded_target
from dflash_gguf.target import FeatureRows, Target

LAYERS = [2, 9, 16, 23, 28]


@pytest.fixture(scope="module")
def target():
    t = Target.open(embedded_target(), n_ctx=512, n_batch=64, n_seq_max=2, n_threads=1)
    t.capture(LAYERS)
    yield t
    t.close()


@pytest.fixture()
def fresh(target):
    target.clear()
    return target


def test_geometry_of_the_embedded_target(target):
    assert (target.n_embd, target.n_layer, target.n_vocab) == (576, 30, 49152)
    assert target.architecture == "llama"
    assert not target.recurrent
    assert target.n_batch == 64 and target.n_ctx == 512 and target.n_ctx_seq == 256


def test_greedy_continuation_is_sensible(fresh):
    toks = fresh.vocab.tokenize("The capital of France is")
    fresh.decode(toks, 0)
    assert fresh.vocab.token_bytes(int(fresh.logits(len(toks) - 1).argmax())) == b" Paris"


def test_layer_zero_input_is_the_token_embedding(fresh):
    """Capture order and row order: layer input 0 is exactly the (dequantised) embedding row."""
    toks = fresh.vocab.tokenize("one two three")
    fresh.capture([0, 5])
    try:
        fresh.decode(toks, 0)
        feats = fresh.features(len(toks))
    finally:
        fresh.capture(LAYERS)
    emb = fresh.token_embeddings()
    assert feats.shape == (len(toks), 2 * 576)
    np.testing.assert_array_equal(feats[:, :576], emb[toks])
    assert not np.allclose(feats[:, 576:], emb[toks])


def test_every_way_of_reading_features_gives_the_same_rows(fresh):
    """One row (the loop's plain cycle), one layer, and several rows of several layers are copied by
    different paths (Target.features): each row must be the same bytes whichever way it is read."""
    toks = fresh.vocab.tokenize("one two three four five")
    fresh.decode(toks, 0)
    whole = fresh.features(len(toks))
    for i in range(len(toks)):
        np.testing.assert_array_equal(fresh.features(1, offset=i)[0], whole[i])
    np.testing.assert_array_equal(fresh.features(2, offset=1), whole[1:3])
    fresh.capture([9])  # LAYERS[1]
    try:
        fresh.clear()
        fresh.decode(toks, 0)  # the same batch again: the same numbers
        np.testing.assert_array_equal(fresh.features(len(toks) - 1, offset=1), whole[1:, 576:2 * 576])
    finally:
        fresh.capture(LAYERS)


def test_feature_rows_gather_decodes_as_the_loop_does(fresh):
    """The loop appends each decode's rows into one FeatureRows (no allocation per cycle): what it gathers,
    across a prefill and single-token decodes and past the buffer's first capacity, is what features() reads."""
    toks = fresh.vocab.tokenize("one two three four five six seven")
    rows = FeatureRows(fresh.feature_width, capacity=1)
    fresh.decode(toks[:4], 0)
    expected = [fresh.features(4)]
    fresh.append_features(rows, 4)
    for i, tok in enumerate(toks[4:], start=4):
        fresh.decode([tok], i, logits=True)
        expected.append(fresh.features(1))
        fresh.append_features(rows, 1)
    assert len(rows) == len(toks)
    np.testing.assert_array_equal(rows.view(), np.concatenate(expected))
    with pytest.raises(ValueError, match="width"):
        fresh.append_features(FeatureRows(fresh.feature_width + 1), 1)
    rows.clear()
    assert rows.view().shape == (0, fresh.feature_width)
    assert rows._data.shape[0] == 1  # grown past 4x its capacity: given back


def test_logits_view_follows_the_last_decode(fresh):
    """output_logits reuses its view while libllama's buffer stays put: it must still show each decode's rows."""
    toks = fresh.vocab.tokenize("Hello world, this is")
    fresh.decode(toks, 0, logits=True)
    many = fresh.output_logits()
    assert many.shape == (len(toks), fresh.n_vocab) and not many.flags.writeable
    np.testing.assert_array_equal(many[-1], fresh.logits(len(toks) - 1))
    fresh.decode([toks[0]], len(toks), logits=True)
    one = fresh.output_logits()
    assert one.shape == (1, fresh.n_vocab)
    np.testing.assert_array_equal(one[0], fresh.logits(0))
    before = one[0].copy()
    fresh.decode([toks[1]], len(toks) + 1, logits=True)
    assert not np.array_equal(fresh.output_logits()[0], before)
    np.testing.assert_array_equal(fresh.output_logits()[0], fresh.logits(0))


def test_features_and_logits_do_not_depend_on_batch_neighbours(fresh):
    a = fresh.vocab.tokenize("Hello world, this is")
    b = fresh.vocab.tokenize("def f(x): return")
    fresh.decode(a + b, list(range(len(a))) + list(range(len(b))), [0] * len(a) + [1] * len(b), logits=True)
    both_feats = fresh.features(len(b), offset=len(a))
    both_logits = fresh.output_logits()[len(a):].copy()
    fresh.clear()
    fresh.decode(b, 0, 1, logits=True)
    np.testing.assert_allclose(fresh.features(len(b)), both_feats, atol=1e-4)
    np.testing.assert_allclose(fresh.output_logits(), both_logits, atol=1e-3)
    assert fresh.features(len(b)).shape == (len(b), len(LAYERS) * 576)


def test_remove_rolls_the_cache_back(fresh):
    toks = fresh.vocab.tokenize("Speculative decoding verifies a block of draft tokens")
    fresh.decode(toks, 0, logits=True)
    ref = fresh.logits(len(toks) - 1)
    fresh.remove(0, 5)
    assert fresh.pos_max(0) == 4
    fresh.decode(toks[5:], 5)
    np.testing.assert_allclose(fresh.logits(len(toks) - 6), ref, atol=1e-3)


def test_logits_flags_select_output_rows(fresh):
    toks = fresh.vocab.tokenize("a b c d")
    fresh.decode(toks, 0, logits=[True, False, True, False])
    assert fresh.output_logits().shape == (2, 49152)
    np.testing.assert_array_equal(fresh.output_logits()[1], fresh.logits(2))
    with pytest.raises(IndexError):
        fresh.logits(1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokens=[49152], positions=0), "token ids"),
        (dict(tokens=[-1], positions=0), "token ids"),
        (dict(tokens=[], positions=0), "at least one token"),
        (dict(tokens=[1] * 65, positions=0), "n_batch"),
        (dict(tokens=[1], positions=256), "positions"),
        (dict(tokens=[1], positions=-1), "positions"),
        (dict(tokens=[1, 2], positions=[0]), "positions for"),
        (dict(tokens=[1], positions=0, seq_ids=2), "sequence ids"),
        (dict(tokens=[1], positions=0, logits="all"), "logits"),
    ],
)
def test_bad_decode_input_raises_before_c(fresh, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fresh.decode(**kwargs)


def test_inconsistent_positions_are_a_runtime_error_not_an_abort(fresh):
    fresh.decode([1, 2], 0)
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        fresh.decode([3], 10)


def test_bad_capture_requests(fresh):
    with pytest.raises(ValueError, match="out of range"):
        fresh.capture([30])  # llama's graph records inputs of layers 0..n_layer-1 only
    with pytest.raises(ValueError, match="at least one"):
        fresh.capture([])
    with pytest.raises(ValueError, match="seq_id"):
        fresh.remove(5, 0)


def test_features_before_any_decode_is_refused():
    with Target.open(embedded_target(), n_ctx=64, n_batch=8, n_threads=1) as t:
        t.capture([1])
        with pytest.raises(RuntimeError, match="decode"):
            t.features(1)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        Target.open(tmp_path / "nope.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="not a GGUF"):
        Target.open(junk)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(embedded_target().read_bytes()[: 1 << 20])
    with pytest.raises(ValueError, match="could not load"):
        Target.open(truncated)
    with pytest.raises(ValueError, match="n_ctx"):
        Target.open(embedded_target(), n_ctx=0)

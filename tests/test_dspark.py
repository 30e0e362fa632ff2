"""DSpark drafters end to end: DeepSpec-layout checkpoints convert, libllama runs them, and what it drafts
(Markov-biased logits, confidences, both block layouts, reduced vocabulary) matches a numpy forward written
from DeepSpec's semantics; greedy output equals plain decoding; bad input is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import MASK_TOKEN_ID, VOCAB_SIZE, loaded_model, meta, reader
from dspark_reference import DRAFT_VOCAB, MARKOV_RANK, Weights, make_dspark_checkpoint, reference_block
from dflash_gguf import SamplingParams, Session, Target
from dflash_gguf.confidence import best_verify_length, check_threshold, confident_prefix, expected_committed
from dflash_gguf.convert import convert_checkpoint, drafter_info, format_info
from dflash_gguf.convert.cli import main
from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.drafter import Drafter
from dflash_gguf.schema import Keys, Tensors
from dflash_gguf.target_gguf import drafter_verify_tokens, field_value

BLOCK = 8
VARIANTS = {
    # name: (anchor_first, confidence, draft_vocab, schema)
    "anchor": (True, True, None, "deepspec"),
    "bonus": (False, True, None, "deepspec"),
    "anchor-noconf": (True, False, None, "deepspec"),
    "reduced": (True, True, DRAFT_VOCAB, "deepspec"),
    "speculators": (False, True, None, "speculators"),
    "speculators-anchor": (True, False, DRAFT_VOCAB, "speculators"),
}


def variants(*names: str) -> list:
    """Parameters for these variants: "anchor" in the quick tier, the others in the full suite only
    (each variant is a checkpoint built and converted, then a Session of its own)."""
    return [name if name == "anchor" else pytest.param(name, marks=pytest.mark.slow) for name in names]


class Built:
    """Each variant's checkpoint and GGUF, built on first use and kept for the session."""

    def __init__(self, root: Path, target: Path) -> None:
        self.root, self.target, self._done = root, target, {}

    def __call__(self, name: str) -> tuple[Path, Path]:
        if name not in self._done:
            anchor, conf, vocab, schema = VARIANTS[name]
            ck = make_dspark_checkpoint(self.root / name, anchor_first=anchor, confidence=conf, draft_vocab=vocab,
                                        schema=schema, block_size=BLOCK)
            out = convert_checkpoint(ck, self.root / f"{name}.gguf", target=self.target, progress=False)
            self._done[name] = (ck, out)
        return self._done[name]


@pytest.fixture(scope="module")
def target(embedded_target):
    with Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as t:
        yield t


@pytest.fixture(scope="module")
def embeddings(target):
    return target.token_embeddings()


# --- conversion ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", variants(*VARIANTS))
def test_dspark_gguf_holds_the_heads_libllama_reads(dspark, name):
    anchor, conf, vocab, _ = VARIANTS[name]
    ck, out = dspark(name)
    r = reader(out)
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in r.tensors}
    assert shapes[Tensors.MARKOV_W1] == (MARKOV_RANK, VOCAB_SIZE)  # ggml order
    assert shapes[Tensors.MARKOV_W2] == (MARKOV_RANK, vocab or VOCAB_SIZE)
    assert (Tensors.CONF_PROJ in shapes) == conf
    if conf:
        assert shapes[Tensors.CONF_PROJ] == (576 + MARKOV_RANK, 1)
        assert shapes[Tensors.CONF_PROJ_BIAS] == (1,)
    assert (Tensors.D2T in shapes) == bool(vocab)
    assert field_value(r, Keys.SAMPLE_FROM_ANCHOR) is anchor
    assert field_value(r, Keys.HAS_CONFIDENCE_HEAD) is conf
    assert field_value(r, Keys.BLOCK_SIZE) == BLOCK
    assert field_value(r, Keys.TARGET_LAYERS) == [2, 9, 16, 23, 28]
    assert field_value(r, Keys.MASK_TOKEN_ID) == MASK_TOKEN_ID
    with loaded_model(out) as model:
        assert meta(model, Keys.SAMPLE_FROM_ANCHOR) == str(anchor).lower()
    info = drafter_info(out)
    assert (info.kind, info.markov_rank, info.has_confidence_head, info.sample_from_anchor) == ("dspark", MARKOV_RANK, conf, anchor)
    text = format_info(info)
    assert "(DSpark)" in text and f"markov rank:" in text and ("confidence head:    yes" in text) == conf


@pytest.mark.slow  # the reduced-vocabulary variant, built for this
def test_markov_weights_round_trip_exactly(dspark):
    ck, out = dspark("reduced")
    want = {k: v.to(torch.float32).numpy() for k, v in load_file(ck / "model.safetensors").items() if v.is_floating_point()}
    got = {t.name: t for t in reader(out).tensors}
    import gguf

    for hf, name in [("markov_head.markov_w1.weight", Tensors.MARKOV_W1), ("markov_head.markov_w2.weight", Tensors.MARKOV_W2),
                     ("confidence_head.proj.weight", Tensors.CONF_PROJ), ("confidence_head.proj.bias", Tensors.CONF_PROJ_BIAS)]:
        t = got[name]
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want[hf].shape)
        np.testing.assert_array_equal(values, want[hf], err_msg=name)
    d2t = np.asarray(got[Tensors.D2T].data).reshape(-1)
    offsets = load_file(ck / "model.safetensors")["d2t"].numpy()
    np.testing.assert_array_equal(d2t, offsets + np.arange(offsets.size))


# --- the native forward against the reference ---------------------------------------------------------


def _drafter_and_reference(dspark, name, target, embeddings):
    ck, out = dspark(name)
    drafter = Drafter(out, target)
    return drafter, Weights.load(ck, embeddings, embeddings)


@pytest.mark.parametrize("name", variants(*VARIANTS))
def test_native_block_matches_the_reference_forward(dspark, name, target, embeddings):
    anchor, conf, vocab, _ = VARIANTS[name]
    drafter, w = _drafter_and_reference(dspark, name, target, embeddings)
    try:
        assert drafter.kind == "dspark"
        assert drafter.max_draft == (BLOCK if anchor else BLOCK - 1)  # anchor-first: B drafts from a block of B
        # what a hybrid target's snapshots are sized from, read before any context exists: the longest verify
        assert drafter_verify_tokens(dspark(name)[1]) == drafter.max_draft + 1
        assert drafter.has_confidence_head == conf
        rng = np.random.default_rng(1)
        p0 = 7
        feats = rng.standard_normal((p0, drafter.n_features)).astype(np.float32)
        drafter.inject(feats, 0)
        for n in (1, drafter.max_draft):
            got = np.array(drafter.draft(321, p0, n))
            confidences = drafter.last_confidences
            want, want_conf, want_tokens = reference_block(w, feats, 321, p0, n, anchor_first=anchor)
            finite = np.isfinite(want)
            assert (np.isfinite(got) == finite).all()  # a reduced vocabulary leaves -inf outside its rows
            scale = np.abs(want[finite]).max()
            # the target's embeddings/head are Q4_1 and ggml multiplies in bf16/q8 activations: 0.3% of the range
            assert np.abs(got[finite] - want[finite]).max() <= 3e-3 * scale, name
            top2 = np.sort(np.where(finite, want, -np.inf), axis=1)[:, -2:]
            clear = top2[:, 1] - top2[:, 0] > 6e-3 * scale
            np.testing.assert_array_equal(got.argmax(1)[clear], want_tokens[clear])
            if conf:
                np.testing.assert_allclose(confidences, want_conf, atol=5e-3)
            else:
                assert confidences is None
        assert drafter.pos_max() == p0 - 1  # the block's noise K/V was dropped
    finally:
        drafter.close()


@pytest.mark.slow  # the bonus-anchor variant, built for this
def test_markov_bias_changes_the_draft(dspark, embeddings):
    """The head is live: without its bias the reference drafts other tokens (else the test above proves little)."""
    ck, _ = dspark("bonus")
    w = Weights.load(ck, embeddings, embeddings)
    feats = np.random.default_rng(1).standard_normal((7, 5 * 576)).astype(np.float32)
    with_head = reference_block(w, feats, 321, 7, BLOCK - 1, anchor_first=False)[2]
    w.t["markov_head.markov_w2.weight"] = np.zeros_like(w.t["markov_head.markov_w2.weight"])
    without = reference_block(w, feats, 321, 7, BLOCK - 1, anchor_first=False)[2]
    assert (with_head != without).any()


@pytest.mark.parametrize("name", variants("anchor", "reduced"))
def test_sampled_drafts_report_the_q_they_were_drawn_from(dspark, name, target, embeddings):
    """Each sampled token's q is the reference's row conditioned on the token sampled before it (not the argmax)."""
    anchor = VARIANTS[name][0]
    drafter, w = _drafter_and_reference(dspark, name, target, embeddings)
    try:
        rng = np.random.default_rng(2)
        p0 = 5
        feats = rng.standard_normal((p0, drafter.n_features)).astype(np.float32)
        drafter.inject(feats, 0)
        params = SamplingParams(temperature=1.5)
        diverged = 0
        for seed in range(6):
            p = drafter.propose(77, p0, drafter.max_draft, params, np.random.default_rng(seed))
            want, want_conf, _ = reference_block(w, feats, 77, p0, drafter.max_draft, anchor_first=anchor, tokens=p.tokens)
            from dflash_gguf.sampling import probabilities

            ref_q = probabilities(want, params)
            assert np.abs(p.q - ref_q).sum(axis=1).max() < 0.05  # total variation, Q4_1 target head
            np.testing.assert_allclose(p.confidences, want_conf, atol=1e-2)
            assert all(p.q[i, t] > 0 for i, t in enumerate(p.tokens))
            greedy_chain = reference_block(w, feats, 77, p0, drafter.max_draft, anchor_first=anchor)[0]
            diverged += int(np.abs(probabilities(greedy_chain, params) - ref_q).sum(axis=1).max() > 0.05)
        assert diverged > 0  # the argmax-conditioned rows differ: the correction was needed
    finally:
        drafter.close()


# --- a Session on a DSpark drafter --------------------------------------------------------------------


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def plain_texts(embedded_target):
    with Session(n_ctx=256, n_batch=64, n_threads=1) as s:
        return [s.generate(p, max_tokens=24, temperature=0.0, speculative=False).tokens for p in PROMPTS]


@pytest.mark.slow  # a Session per variant, three prompts of 24 tokens drafted in blocks of 8
@pytest.mark.parametrize("name", ["anchor", "bonus", "reduced"])
def test_greedy_session_equals_plain_decoding(dspark, name, plain_texts):
    _, out = dspark(name)
    with Session(drafter=out, n_ctx=256, n_batch=64, n_threads=1) as s:
        for prompt, plain in zip(PROMPTS, plain_texts):
            result = s.generate(prompt, max_tokens=24, temperature=0.0, block_size=BLOCK)
            assert result.tokens == plain, prompt
        steps = s.last_steps if hasattr(s, "last_steps") else None
        assert steps is None or any(st.n_drafted for st in steps)


@pytest.mark.slow  # 240 seeded generations
def test_sampled_session_follows_the_target_distribution(dspark, embedded_target):
    from collections import Counter

    from test_session_sampling import ALPHA, PROMPT, chi_square_p_value, next_token_probs

    _, out = dspark("anchor")
    params = SamplingParams(temperature=1.0)
    with Session(drafter=out, n_ctx=256, n_batch=64, n_threads=1) as s:
        # the first token comes from the prefill, the second from a cycle that drafts one token (max_tokens
        # leaves room for one draft) and accepts or resamples it against the drafter's q
        runs = [s.generate(PROMPT, max_tokens=3, temperature=1.0, seed=seed, block_size=2) for seed in range(240)]
    assert sum(r.stats.n_drafted for r in runs) >= 240
    pairs = [r.tokens for r in runs]
    with Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as ref:
        prompt = ref.vocab.tokenize(PROMPT)
        first = [p[0] for p in pairs]
        assert chi_square_p_value(first, next_token_probs(ref, prompt, params)) > ALPHA
        mode = Counter(first).most_common(1)[0][0]
        second = [p[1] for p in pairs if p[0] == mode]
        assert len(second) > 120
        assert chi_square_p_value(second, next_token_probs(ref, prompt + [mode], params)) > ALPHA
        assert chi_square_p_value(second, next_token_probs(ref, prompt, params)) < ALPHA  # the check can fail


# --- bad input ----------------------------------------------------------------------------------------


def _variant(dspark, tmp_path, name="anchor") -> Path:
    ck, _ = dspark(name)
    dst = tmp_path / "ck"
    shutil.copytree(ck, dst)
    return dst


def _edit_config(ck: Path, **changes) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(changes)
    (ck / "config.json").write_text(json.dumps(cfg))


def _edit_tensor(ck: Path, name: str, value) -> None:
    state = load_file(ck / "model.safetensors")
    state[name] = value
    save_file(state, ck / "model.safetensors")


def _assert_refused(capsys, ck: Path, out: Path, *words: str) -> None:
    capsys.readouterr()  # what building the checkpoint printed is not the converter's
    try:
        code = main([str(ck), str(out), "--no-progress"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


def test_unknown_markov_head_type_is_refused(dspark, tmp_path, capsys):
    ck = _variant(dspark, tmp_path)
    _edit_config(ck, markov_head_type="gated")
    _assert_refused(capsys, ck, tmp_path / "o.gguf", "markov_head_type", "gated", "vanilla")


def test_markov_shape_against_the_vocabulary_is_refused(dspark, tmp_path, capsys):
    ck = _variant(dspark, tmp_path)
    _edit_tensor(ck, "markov_head.markov_w2.weight", torch.zeros(1000, MARKOV_RANK, dtype=torch.bfloat16))
    _assert_refused(capsys, ck, tmp_path / "o.gguf", "markov_w2", "[1000, 32]", f"[{VOCAB_SIZE}, 32]")


def test_markov_rank_against_the_config_is_refused(dspark, tmp_path, capsys):
    ck = _variant(dspark, tmp_path)
    _edit_config(ck, markov_rank=16)
    _assert_refused(capsys, ck, tmp_path / "o.gguf", "markov_w1", "[49152, 16]")


def test_d2t_size_mismatch_is_refused(dspark, tmp_path, capsys):
    ck = _variant(dspark, tmp_path, "reduced")
    _edit_tensor(ck, "d2t", torch.zeros(DRAFT_VOCAB - 1, dtype=torch.int64))
    _assert_refused(capsys, ck, tmp_path / "o.gguf", "d2t", f"[{DRAFT_VOCAB - 1}]", f"[{DRAFT_VOCAB}]")


def test_confidence_head_without_markov_features_is_refused(dspark, tmp_path, capsys):
    ck = _variant(dspark, tmp_path)
    _edit_tensor(ck, "confidence_head.proj.weight", torch.zeros(1, 576, dtype=torch.bfloat16))
    _assert_refused(capsys, ck, tmp_path / "o.gguf", "confidence_head", "markov")


def test_markov_head_in_a_dflash_checkpoint_is_refused(dspark, tmp_path, capsys):
    ck = _variant(dspark, tmp_path)
    _edit_config(ck, architectures=["DFlashDraftModel"], dflash_config={"block_size": 8, "mask_token_id": 16,
                 "target_layer_ids": [1, 8, 15, 22, 27]})
    _assert_refused(capsys, ck, tmp_path / "o.gguf", "unexpected tensor")  # a Markov or confidence tensor, whichever is met first


def test_markov_rank_zero_is_refused(dspark, tmp_path):
    ck = _variant(dspark, tmp_path)
    _edit_config(ck, markov_rank=0)
    with pytest.raises(ConversionError, match="markov_rank 0"):
        convert_checkpoint(ck, tmp_path / "o.gguf", progress=False)


# --- confidence scheduling ----------------------------------------------------------------------------


def test_confident_prefix_cuts_at_the_first_low_confidence():
    c = [0.9, 0.8, 0.4, 0.95]
    assert confident_prefix(c, 0.5) == 2
    assert confident_prefix(c, 0.0) == 4
    assert confident_prefix(c, 0.95) == 0
    assert confident_prefix(c, 1.0) == 0
    assert confident_prefix([0.9, 0.9], 0.5) == 2


@pytest.mark.parametrize("bad", [-0.01, 1.5, float("nan"), "0.5", True, None])
def test_threshold_outside_zero_one_is_refused(bad):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        check_threshold(bad)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        confident_prefix([0.5], bad)


def test_expected_committed_is_one_plus_the_cumulative_acceptance():
    np.testing.assert_allclose(expected_committed([0.5, 0.5, 1.0]), [1.0, 1.5, 1.75, 2.0])


def test_best_verify_length_maximises_expected_tokens_per_second():
    flat = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0}  # verifying is free up to 16 tokens: take every draft
    assert best_verify_length([0.9] * 7, flat) == 7
    linear = {n: float(n) for n in (1, 2, 4, 8)}  # each token costs a plain step: no draft pays
    assert best_verify_length([0.9] * 7, linear) == 0
    steep = {1: 1.0, 2: 1.1, 3: 1.2, 4: 3.0, 8: 6.0}  # cheap up to 3 tokens, then dear
    assert best_verify_length([0.95] * 7, steep) == 2
    assert best_verify_length([0.95, 0.95, 0.1, 0.95], flat, threshold=0.5) == 2  # never past the cut

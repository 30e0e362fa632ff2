"""Native drafter vs the z-lab torch reference on the same weights, features and embeddings; pairing checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoints import reference_config
from dflash.model import DFlash2DraftModel, DFlashDraftModel

from dflash_gguf.convert import convert_checkpoint
from dflash_gguf.drafter import Drafter, PairingError
from dflash_gguf.sampling import SamplingParams
from dflash_gguf.target import Target

PROMPT = "The quick brown fox jumps over the lazy dog because"
BLOCK = 16


@pytest.fixture(scope="module")
def target(embedded_target):
    t = Target.open(embedded_target, n_ctx=512, n_batch=64, n_threads=1)
    yield t
    t.close()


@pytest.fixture(scope="module")
def embeddings(target):
    return target.token_embeddings()


def _reference_block(ref, target, drafter, embeddings):
    """Features from the real target, then the torch forward over [last, mask x 15]: (hidden, last, n_ctx)."""
    target.clear()
    drafter.clear()
    tokens = target.vocab.tokenize(PROMPT)
    target.decode(tokens, 0)
    features = target.features(len(tokens))
    drafter.inject(features, 0)
    last = int(target.logits(len(tokens) - 1).argmax())
    block = [last] + [drafter.mask_token_id] * (BLOCK - 1)
    with torch.no_grad():
        hidden = ref(
            target_hidden=torch.from_numpy(features)[None],
            noise_embedding=torch.from_numpy(embeddings[block])[None],
            position_ids=torch.arange(len(tokens) + BLOCK)[None],
        )[:, 1:]
    return hidden, last, len(tokens)


def _tied_head(embeddings):
    head = torch.nn.Linear(embeddings.shape[1], embeddings.shape[0], bias=False)
    head.weight.data = torch.from_numpy(embeddings)
    return head


def test_dflash_logits_match_the_reference(target, embeddings, dflash_gguf_path, reference_checkpoint):
    ref = DFlashDraftModel.from_pretrained(reference_checkpoint, torch_dtype=torch.float32).eval()
    with Drafter(dflash_gguf_path, target) as drafter:
        assert drafter.mask_token_id == ref.mask_token_id and drafter.kind != "dflash2"
        assert drafter.layers == [i + 1 for i in ref.target_layer_ids]
        hidden, last, n = _reference_block(ref, target, drafter, embeddings)
        with torch.no_grad():
            expected = ref.compute_logits(hidden, _tied_head(embeddings))[0].numpy()
        native = drafter.draft(last, n, BLOCK - 1).copy()
        assert drafter.pos_max() == n - 1  # the noise block left no K/V behind
    scale = np.abs(expected).max()
    # bf16 weights: libllama rounds activations to bf16/Q8 for its matmuls, torch runs them in f32
    assert np.abs(native - expected).max() < 0.01 * scale
    assert np.corrcoef(native.ravel(), expected.ravel())[0, 1] > 0.9999
    np.testing.assert_array_equal(native.argmax(axis=1), expected.argmax(axis=1))


def test_dflash2_selector_matches_the_reference(target, embeddings, dflash2_gguf_path, reference_checkpoint_dflash2):
    ref = DFlash2DraftModel.from_pretrained(reference_checkpoint_dflash2, torch_dtype=torch.float32).eval()
    with Drafter(dflash2_gguf_path, target) as drafter:
        assert drafter.kind == "dflash2" and drafter.selector_top_k == ref.candidate_selector.top_k
        hidden, last, n = _reference_block(ref, target, drafter, embeddings)
        head = _tied_head(embeddings)
        with torch.no_grad():
            path, candidates, _ = ref.propose(hidden, torch.tensor([last]), head, 0.0)
            logits = ref.compute_logits(hidden, head)
            gate = ref.candidate_selector.hidden_projection(hidden)[0]
        lattice = drafter.draft(last, n, BLOCK - 1).copy()
        proposal = drafter.propose(last, n, BLOCK - 1, SamplingParams(), None)
    np.testing.assert_array_equal(proposal.tokens, path[0].numpy())
    k = drafter.selector_top_k
    sel = ref.candidate_selector
    prev_token, prev_index = last, 0
    for i in range(BLOCK - 1):
        ids = lattice[i, :k].astype(np.int64)
        assert sorted(ids.tolist()) == sorted(candidates[0, i].tolist())
        with torch.no_grad():
            cond = sel.predecessor_codebook(torch.tensor(prev_token)) * gate[i]
            expected = logits[0, i, ids] + sel.successor_codebook(torch.from_numpy(ids)) @ cond
        scores = lattice[i, k + prev_index * k : k + (prev_index + 1) * k]
        np.testing.assert_allclose(scores, expected.numpy(), rtol=0, atol=0.01 * float(expected.abs().max()))
        prev_index = int(np.argmax(scores))
        prev_token = int(ids[prev_index])


def test_sampled_dflash2_proposal_carries_its_candidate_distribution(target, dflash2_gguf_path):
    with Drafter(dflash2_gguf_path, target) as drafter:
        target.clear()
        tokens = target.vocab.tokenize(PROMPT)
        target.decode(tokens, 0)
        drafter.inject(target.features(len(tokens)), 0)
        p = drafter.propose(7, len(tokens), 5, SamplingParams(temperature=1.0), np.random.default_rng(0))
    assert p.q.shape == p.q_ids.shape == (5, drafter.selector_top_k)
    np.testing.assert_allclose(p.q.sum(axis=1), 1.0)
    assert all(tok in row for tok, row in zip(p.tokens, p.q_ids))


def test_bad_draft_requests(target, dflash_gguf_path):
    with Drafter(dflash_gguf_path, target) as drafter:
        with pytest.raises(ValueError, match="n_draft"):
            drafter.draft(1, 0, BLOCK)
        with pytest.raises(ValueError, match="token id"):
            drafter.draft(49152, 0, 3)
        with pytest.raises(ValueError, match="outside the drafter context"):
            drafter.draft(1, 510, 3)
        with pytest.raises(ValueError, match="features must have shape"):
            drafter.inject(np.zeros((2, 576), dtype=np.float32), 0)


def test_target_gguf_is_not_a_drafter(target, embedded_target):
    with pytest.raises(PairingError, match="not a 'dflash' drafter"):
        Drafter(embedded_target, target)


def test_missing_and_corrupt_drafter_files(target, tmp_path, dflash_gguf_path):
    with pytest.raises(FileNotFoundError):
        Drafter(tmp_path / "missing.gguf", target)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(dflash_gguf_path.read_bytes()[:4096])
    with pytest.raises(ValueError, match="could not load"):
        Drafter(truncated, target)


def test_fingerprint_mismatch_is_refused(target, tmp_path, dflash_gguf_path):
    data = dflash_gguf_path.read_bytes()
    fingerprint = target.fingerprint().encode()
    assert data.count(fingerprint) == 1
    other = tmp_path / "other_target.gguf"
    other.write_bytes(data.replace(fingerprint, b"0123456789abcdef"))
    with pytest.raises(PairingError, match="fingerprint 0123456789abcdef"):
        Drafter(other, target)


def _convert_untargeted(tmp_path, name, **config):
    """A real reference checkpoint of another geometry, converted without --target (nothing to check against)."""
    cfg = reference_config()
    for key, value in config.items():
        setattr(cfg, key, value)
    src = tmp_path / f"{name}_ckpt"
    DFlashDraftModel(cfg).to(torch.bfloat16).save_pretrained(src)
    return convert_checkpoint(src, tmp_path / f"{name}.gguf", progress=False)


def test_hidden_size_mismatch_is_refused(target, tmp_path):
    path = _convert_untargeted(
        tmp_path, "h256", hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2
    )
    with pytest.raises(PairingError, match="hidden size 256"):
        Drafter(path, target)


def test_vocabulary_mismatch_is_refused(target, tmp_path):
    path = _convert_untargeted(tmp_path, "v32k", vocab_size=32000)
    with pytest.raises(PairingError, match="vocabulary of 32000"):
        Drafter(path, target)


def test_layer_ids_beyond_the_target_are_refused(target, tmp_path):
    # HF id 29 = output of the last layer = GGUF layer input 30, which the llama graph does not record
    path = _convert_untargeted(tmp_path, "l29", dflash_config={**reference_config().dflash_config, "target_layer_ids": [1, 8, 29]})
    with pytest.raises(PairingError, match=r"layer ids \[30\]"):
        Drafter(path, target)

"""DFlash 2 and DSpark drafters: forwards against references, checkpoints, and their losses.

DFlash 2 is checked against z-lab's `dflash.model.DFlash2DraftModel` loaded from our checkpoint.
DSpark has no installable reference; `reference_dspark_*` below re-state DeepSpec's semantics
(`VanillaMarkov`: logits + W2 W1[prev], chained greedily from the anchor; the confidence head on
[hidden ; W1[prev]]) in the plainest code, independent of the trainer's vectorised version.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from dflash.model import DFlash2DraftModel

from dflash_gguf.kinds.dflash2.training import selector_loss
from dflash_gguf.kinds.dspark.training import dspark_loss
from dflash_gguf.train.model import Drafter, DrafterConfig
from dflash_gguf.train.recipe import IGNORE, block_inputs, block_labels, distill_loss, slot_weights, soft_cross_entropy

VOCAB, HIDDEN, N_FEAT, BLOCK = 120, 64, 3, 6


def config(kind: str, layers: int = 2, draft_vocab: int | None = None) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=VOCAB,
        num_target_layers=12, target_layer_ids=[1, 5, 9], block_size=BLOCK, mask_token_id=7,
        draft_vocab_size=draft_vocab, kind=kind, conv_kernel_size=2, conv_group_size=16, selector_rank=8,
        selector_top_k=5, markov_rank=8,
    )


def random_drafter(cfg: DrafterConfig, d2t: torch.Tensor | None = None, seed: int = 0) -> Drafter:
    g = torch.Generator().manual_seed(seed)
    model = Drafter(cfg, torch.randn(VOCAB, HIDDEN, generator=g), d2t=d2t)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every tensor random, so that a swapped one cannot pass
            scale = 0.3 if p.ndim == 1 else (3.0 if "markov" in name else 1.0 if "selector" in name else 0.5 if "base_kernel" in name else 0.05)
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


def one_block(model: Drafter, anchor: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(1, anchor, N_FEAT * HIDDEN, generator=g)
    tokens = np.random.default_rng(seed).integers(0, VOCAB, anchor + 2 * BLOCK)
    ids, pos = block_inputs(tokens, np.array([anchor]), BLOCK, model.cfg.mask_token_id)
    return features, tokens, torch.from_numpy(ids)[None], torch.from_numpy(pos)[None]


# -- DFlash 2 ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dflash2_pair(tmp_path_factory):
    model = random_drafter(config("dflash2"))
    path = model.save_checkpoint(tmp_path_factory.mktemp("dflash2"))
    ref = DFlash2DraftModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    return model, ref, path


def test_dflash2_checkpoint_loads_in_the_reference_with_every_tensor(dflash2_pair):
    model, ref, path = dflash2_pair
    hf = json.loads((path / "config.json").read_text())
    assert hf["architectures"] == ["DFlash2DraftModel"]
    assert {k: hf["dflash_config"][k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")} == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}
    ours = model.state_dict()
    theirs = ref.state_dict()
    assert {k for k in ours if k not in ("embed", "lm_head_weight")} == {k for k in theirs if "rotary" not in k}
    for name, tensor in theirs.items():
        if name in ours:
            torch.testing.assert_close(tensor, ours[name], rtol=0, atol=0)
    reloaded = Drafter.load_checkpoint(path, model.embed)
    for name, tensor in reloaded.state_dict().items():
        torch.testing.assert_close(tensor, ours[name], rtol=0, atol=0)


def test_dflash2_block_forward_equals_reference(dflash2_pair):
    model, ref, _ = dflash2_pair
    features, tokens, ids, pos = one_block(model)
    anchor = features.shape[1]
    with torch.no_grad():
        ours = model.hidden(features, torch.arange(anchor)[None], ids, pos, None)[0]
        theirs = ref(
            position_ids=torch.arange(anchor + BLOCK)[None],
            noise_embedding=torch.nn.functional.embedding(ids, model.embed),
            target_hidden=features,
        )[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # the convolutions matter: the same weights without them give another answer
    plain = Drafter(config("dflash"), model.embed)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "conv" not in k and "selector" not in k}, strict=False)
    with torch.no_grad():
        assert not torch.allclose(plain.eval().hidden(features, torch.arange(anchor)[None], ids, pos, None)[0], ours, atol=1e-3)


def test_dflash2_packed_blocks_stay_inside_their_block(dflash2_pair):
    """Two blocks packed in one forward under the mask equal the two blocks run alone (the
    convolution never reaches across a block boundary)."""
    from dflash_gguf.train.recipe import attention_mask

    model, _, _ = dflash2_pair
    features, tokens, _, _ = one_block(model, anchor=14)
    anchors = np.array([6, 11])
    ids, pos = block_inputs(tokens, anchors, BLOCK, 7)
    mask = attention_mask(14, 14, anchors, BLOCK)[None, None]
    with torch.no_grad():
        packed = model.hidden(features, torch.arange(14)[None], torch.from_numpy(ids)[None], torch.from_numpy(pos)[None], mask)[0]
        for b, a in enumerate(anchors):
            i1, p1 = block_inputs(tokens, np.array([a]), BLOCK, 7)
            alone = model.hidden(features[:, :a], torch.arange(a)[None], torch.from_numpy(i1)[None], torch.from_numpy(p1)[None], None)[0]
            torch.testing.assert_close(packed[b * BLOCK : (b + 1) * BLOCK], alone, rtol=1e-5, atol=1e-5)


def test_dflash2_selector_path_equals_reference_propose(dflash2_pair):
    model, ref, _ = dflash2_pair
    features, tokens, ids, pos = one_block(model)
    anchor = features.shape[1]
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    head.weight.data.copy_(model.embed)
    with torch.no_grad():
        hidden = model.hidden(features, torch.arange(anchor)[None], ids, pos, None)[:, 1:]
        theirs, _, _ = ref.propose(hidden, ids[:, 0], head, 0.0)
        ours = model.draft(hidden, ids[:, 0])
    assert ours.tolist() == theirs.tolist()
    # and the selector is not a no-op: plain argmax differs somewhere on some block
    differs = False
    for seed in range(2, 12):
        f, t, i, p = one_block(model, seed=seed)
        with torch.no_grad():
            h = model.hidden(f, torch.arange(f.shape[1])[None], i, p, None)[:, 1:]
            differs |= model.draft(h, i[:, 0]).tolist() != model.logits(h).argmax(-1).tolist()
    assert differs


def test_fresh_dflash2_layer_starts_as_a_dflash_layer():
    """Static taps start as the identity and the dynamic ones near zero."""
    torch.manual_seed(0)
    model = Drafter(config("dflash2", layers=1), torch.randn(VOCAB, HIDDEN))
    conv = model.layers[0].attention_conv
    x = torch.randn(1, 2 * BLOCK, HIDDEN)
    out, _ = conv.prepare(x)
    assert (out - x).abs().max() < 0.5 * x.abs().max()
    assert torch.equal(conv.base_kernel[:, 0], torch.ones(2, HIDDEN)) and torch.equal(conv.base_kernel[:, 1], torch.zeros(2, HIDDEN))


# -- DSpark -----------------------------------------------------------------------------------


def reference_dspark_draft(logits_fn, w1, w2, hidden, anchor):
    """DeepSpec's greedy block sampling, one block, loops only: slot j's logits get W2 W1[prev],
    prev starting at the anchor and then each pick."""
    prev = int(anchor)
    picks = []
    for j in range(hidden.shape[0]):
        row = logits_fn(hidden[j]) + w2 @ w1[prev]
        pick = int(torch.argmax(row))
        picks.append(pick)
        prev = pick
    return picks


def test_dspark_draft_equals_the_deepspec_semantics():
    model = random_drafter(config("dspark"))
    with torch.no_grad():
        model.markov_head.markov_w2.weight.mul_(4.0)  # a bias on the scale of the logits of a mask slot
    features, tokens, ids, pos = one_block(model)
    anchor = features.shape[1]
    with torch.no_grad():
        hidden = model.hidden(features, torch.arange(anchor)[None], ids, pos, None)
        ours = model.draft(hidden[:, : BLOCK - 1], ids[:, 0])[0].tolist()
        ref = reference_dspark_draft(
            lambda h: model.embed @ h, model.markov_head.markov_w1.weight, model.markov_head.markov_w2.weight,
            hidden[0, : BLOCK - 1], ids[0, 0],
        )
        plain = model.logits(hidden[0, : BLOCK - 1]).argmax(-1).tolist()
    assert ours == ref
    assert ours != plain  # the Markov bias changes the draft


def test_dspark_confidence_is_a_linear_map_of_hidden_and_the_previous_token():
    model = random_drafter(config("dspark"))
    h = torch.randn(5, HIDDEN)
    prev = torch.tensor([3, 9, 0, 119, 3])
    with torch.no_grad():
        got = model.confidence(h, prev)
        w, b = model.confidence_head.proj.weight[0], model.confidence_head.proj.bias[0]
        want = torch.stack([w @ torch.cat([h[i], model.markov_head.markov_w1.weight[prev[i]]]) + b for i in range(5)])
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_dspark_reduced_vocab_markov_bias_lands_on_the_draft_rows(tmp_path):
    d2t = torch.tensor(sorted(np.random.default_rng(0).choice(VOCAB, 40, replace=False).tolist()))
    model = random_drafter(config("dspark", draft_vocab=40), d2t=d2t)
    assert model.markov_head.markov_w1.weight.shape == (VOCAB, 8)  # previous tokens are target ids
    assert model.markov_head.markov_w2.weight.shape == (40, 8)  # the bias is over the draft rows
    h = torch.randn(2, HIDDEN)
    prev = torch.tensor([5, 6])
    with torch.no_grad():
        torch.testing.assert_close(model.step_logits(h, prev), model.logits(h) + model.markov_head.bias(prev))
    model.save_checkpoint(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["DSparkDraftModel"] and hf["markov_rank"] == 8 and hf["markov_head_type"] == "vanilla"
    assert hf["enable_confidence_head"] and hf["confidence_head_with_markov"] and hf["sample_from_anchor"]
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "lm_head.weight", "d2t"} <= names
    back = Drafter.load_checkpoint(tmp_path, model.embed)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(back.state_dict()[k], v, rtol=0, atol=0)


def test_dspark_tensor_names_are_the_ones_upstreams_converter_maps():
    """llama.cpp's gguf-py (vendored beside its converter) maps every DSpark tensor we write."""
    import importlib.util
    import sys
    from pathlib import Path

    from upstream import LLAMA_CPP_SRC

    candidates = [LLAMA_CPP_SRC / "gguf-py"]
    root = next((c for c in candidates if (c / "gguf" / "tensor_mapping.py").is_file()), None)
    if root is None:
        pytest.skip("llama.cpp's gguf-py sources are not on this machine")
    saved = {k: v for k, v in sys.modules.items() if k == "gguf" or k.startswith("gguf.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(root))
    try:
        import gguf as upstream

        tmap = upstream.get_tensor_name_map(upstream.MODEL_ARCH.DFLASH, 2)
        model = random_drafter(config("dspark"))
        for name in model.state_dict():
            if name in ("embed", "lm_head_weight"):
                continue
            assert tmap.get_name("model." + name, try_suffixes=(".weight", ".bias")) is not None, name
    finally:
        sys.path.remove(str(root))
        for k in [k for k in sys.modules if k == "gguf" or k.startswith("gguf.")]:
            del sys.modules[k]
        sys.modules.update(saved)


# -- losses on hand-computed cases ------------------------------------------------------------


def test_soft_cross_entropy_by_hand():
    logits = torch.tensor([[0.0, math.log(3.0), 0.0, 0.0]])  # q = (1/6, 3/6, 1/6, 1/6)
    ids = torch.tensor([[1, 2, -1]])
    vals = torch.tensor([[0.0, 0.0, 5.0]])  # p = (1/2 on row 1, 1/2 on row 2); the -1 entry dropped
    ce, has = soft_cross_entropy(logits, ids, vals)
    assert has.tolist() == [True]
    torch.testing.assert_close(ce, torch.tensor([-(0.5 * math.log(0.5) + 0.5 * math.log(1 / 6))]))


def test_distill_loss_mixes_hard_and_soft():
    logits = torch.tensor([[0.0, math.log(3.0), 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    labels = torch.tensor([1, 3])
    weights = torch.tensor([1.0, 3.0])
    ids = torch.tensor([[2], [-1]])  # the second row has no soft target
    vals = torch.tensor([[1.0], [0.0]])
    hard = (1.0 * -math.log(0.5) + 3.0 * -math.log(0.25)) / 4.0
    soft = -math.log(1 / 6)  # only row 0, p = 1 on row 2
    loss, acc = distill_loss(logits, labels, weights, ids, vals, 0.25)
    torch.testing.assert_close(loss, torch.tensor(0.75 * hard + 0.25 * soft))
    assert float(acc) == 0.5
    plain, _ = distill_loss(logits, labels, weights, ids, vals, 0.0)
    torch.testing.assert_close(plain, torch.tensor(hard))


def test_selector_loss_by_hand():
    scores = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0], [5.0, 0.0]])
    candidates = torch.tensor([[10, 11], [12, 13], [14, 15]])
    truth = torch.tensor([10, 13, 99])  # the third truth is no candidate: skipped
    weights = torch.tensor([1.0, 1.0, 7.0])
    want = (-math.log(0.25) + -math.log(0.5)) / 2
    torch.testing.assert_close(selector_loss(scores, candidates, truth, weights), torch.tensor(want))


def test_dspark_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])  # q = (.5, .5), (.75, .25)
    labels = torch.tensor([0, IGNORE])
    weights = torch.tensor([2.0, 1.0])
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    conf = torch.tensor([0.0, 3.0])
    loss, stats = dspark_loss(logits, labels, weights, conf, p, ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0)
    ce, l1, accept = math.log(2.0), 1.0, 0.5  # only row 0 is scored
    bce = -(0.5 * math.log(0.5) + 0.5 * math.log(0.5))  # sigmoid(0) = .5 against target .5
    torch.testing.assert_close(loss, torch.tensor(0.1 * ce + 0.9 * l1 + bce))
    assert stats["accept"] == pytest.approx(accept)


def test_dspark_loss_with_a_top_k_target_lumps_the_missing_mass():
    """DeepSpec's p is dense; the cache keeps the target's top-k log-probabilities. The kept tokens
    carry their true p (not renormalised) and the rest is one outcome, so the L1 is the total
    variation over {kept tokens, the rest}: q = (.5, .25, .125, .125), p known = (.6, .1), rest .3."""
    logits = torch.log(torch.tensor([[4.0, 2.0, 1.0, 1.0]]))
    labels, weights, conf = torch.tensor([0]), torch.tensor([1.0]), torch.tensor([1.0])
    p = torch.tensor([[0.6, 0.1, 0.0, 0.0]])
    _, stats = dspark_loss(logits, labels, weights, conf, p, ce_weight=0.0, l1_weight=1.0, confidence_weight=0.0)
    l1 = abs(0.5 - 0.6) + abs(0.25 - 0.1) + abs((0.125 + 0.125) - 0.3)
    assert stats["l1"] == pytest.approx(l1) and stats["accept"] == pytest.approx(1 - l1 / 2)
    # renormalising the kept entries (p = (6/7, 1/7)) would claim a distance of 0.714 instead of 0.30
    assert l1 == pytest.approx(0.30)
    # a full distribution, dense or one-hot, gives exactly DeepSpec's sum |q - p|
    for dense in ([[0.6, 0.1, 0.3, 0.0]], [[0.0, 1.0, 0.0, 0.0]]):
        d = torch.tensor(dense)
        _, stats = dspark_loss(logits, labels, weights, conf, d, ce_weight=0.0, l1_weight=1.0, confidence_weight=0.0)
        expected = float((torch.softmax(logits, -1) - d).abs().sum())
        assert stats["l1"] == pytest.approx(expected)


def test_dspark_confidence_target_is_each_slots_own_acceptance_not_the_prefix_product():
    """DeepSpec (loss.py) trains the confidence head on accept_rate per slot, 1 - ||q - p||_1 / 2, and
    only its metrics take the cumulative product. Two slots with a = .75 and .5, confidence logit 1:
    BCE_i = softplus(1) - a_i, weighted 2 : 1."""
    logits = torch.log(torch.tensor([[3.0, 1.0], [1.0, 1.0]]))  # q = (.75, .25), (.5, .5)
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # a = .75, .5 (a prefix product would give .375 to slot 2)
    labels, weights, conf = torch.tensor([0, 1]), torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0])
    loss, stats = dspark_loss(logits, labels, weights, conf, p, ce_weight=0.0, l1_weight=0.0, confidence_weight=1.0)
    softplus1 = math.log1p(math.e)
    bce = (2 * (softplus1 - 0.75) + 1 * (softplus1 - 0.5)) / 3
    torch.testing.assert_close(loss, torch.tensor(bce))
    assert stats["accept"] == pytest.approx((2 * 0.75 + 0.5) / 3)


def test_cached_top_k_values_are_log_probabilities_of_the_full_vocabulary():
    from dflash_gguf.train.data import top_k_rows

    logits = np.random.default_rng(0).normal(size=(3, 50)).astype(np.float32) * 3
    ids, vals = top_k_rows(logits, 4)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    np.testing.assert_array_equal(ids, np.argsort(-logits, axis=1)[:, :4])
    np.testing.assert_allclose(vals.astype(np.float32), np.take_along_axis(logp, ids, axis=1), rtol=2e-3, atol=2e-3)


def test_dspark_labels_and_weights_are_shifted_by_one():
    tokens = np.arange(100, 120)
    assert block_labels(tokens, np.array([3]), 4, shift=1).tolist() == [104, 105, 106, 107]
    assert block_labels(tokens, np.array([3]), 4).tolist() == [IGNORE, 104, 105, 106]
    assert block_labels(tokens, np.array([17]), 4, shift=1).tolist() == [118, 119, IGNORE, IGNORE]
    np.testing.assert_allclose(slot_weights(4, 2.0, shift=1), np.exp(-np.arange(4) / 2.0))
    np.testing.assert_allclose(slot_weights(4, 2.0), [0.0, 1.0, np.exp(-0.5), np.exp(-1.0)])

"""The torch drafter against the z-lab reference: same forward on the same weights, loadable checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dflash.model import DFlashDraftModel

from dflash_gguf.train.model import Drafter, DrafterConfig
from dflash_gguf.train.pipeline import target_layer_ids
from dflash_gguf.train.recipe import attention_mask, block_inputs

VOCAB, HIDDEN, N_FEAT, BLOCK = 120, 64, 3, 4


def small_config(layers: int = 2, draft_vocab: int | None = None) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=VOCAB,
        num_target_layers=12, target_layer_ids=[1, 5, 9], block_size=BLOCK, mask_token_id=7,
        draft_vocab_size=draft_vocab,
    )


def random_drafter(cfg: DrafterConfig, d2t: torch.Tensor | None = None) -> Drafter:
    g = torch.Generator().manual_seed(0)
    model = Drafter(cfg, torch.randn(VOCAB, HIDDEN, generator=g), d2t=d2t)
    with torch.no_grad():
        for p in model.parameters():  # norms too, so that a swapped norm cannot pass
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else 0.05) + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(our drafter, the reference loaded from our checkpoint)."""
    model = random_drafter(small_config())
    path = model.save_checkpoint(tmp_path_factory.mktemp("ckpt"))
    ref = DFlashDraftModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    return model, ref


def reference_block(ref, model, features, tokens, anchor):
    """The reference's inference call: context = features before the anchor, block at anchor.."""
    ids, _ = block_inputs(tokens, np.array([anchor]), BLOCK, model.cfg.mask_token_id)
    ids = torch.from_numpy(ids)[None]
    with torch.no_grad():
        return ref(
            position_ids=torch.arange(anchor + BLOCK)[None],
            noise_embedding=torch.nn.functional.embedding(ids, model.embed),
            target_hidden=features[:, :anchor],
        )[0]


def test_reference_loads_the_checkpoint_with_its_dflash_config(pair):
    model, ref = pair
    assert ref.target_layer_ids == [1, 5, 9]
    assert ref.block_size == BLOCK and ref.mask_token_id == 7
    ours = model.state_dict()
    for name, tensor in ref.state_dict().items():
        if name in ours:
            torch.testing.assert_close(tensor, ours[name], rtol=0, atol=0)
    assert {k for k in ours if k not in ("embed", "lm_head_weight")} <= set(ref.state_dict())


def test_one_block_forward_equals_reference(pair):
    model, ref = pair
    g = torch.Generator().manual_seed(1)
    features = torch.randn(1, 10, N_FEAT * HIDDEN, generator=g)
    tokens = np.random.default_rng(1).integers(0, VOCAB, 20)
    anchor = 10
    ids, pos = block_inputs(tokens, np.array([anchor]), BLOCK, 7)
    with torch.no_grad():
        ours = model.hidden(features, torch.arange(anchor)[None], torch.from_numpy(ids)[None], torch.from_numpy(pos)[None], None)[0]
    torch.testing.assert_close(ours, reference_block(ref, model, features, tokens, anchor), rtol=1e-5, atol=1e-5)


def test_packed_blocks_under_the_mask_equal_separate_reference_blocks(pair):
    model, ref = pair
    g = torch.Generator().manual_seed(2)
    features = torch.randn(1, 12, N_FEAT * HIDDEN, generator=g)
    tokens = np.random.default_rng(2).integers(0, VOCAB, 20)
    anchors = np.array([3, 7, 12])
    ids, pos = block_inputs(tokens, anchors, BLOCK, 7)
    mask = attention_mask(12, 12, anchors, BLOCK)[None, None]
    with torch.no_grad():
        packed = model.hidden(features, torch.arange(12)[None], torch.from_numpy(ids)[None], torch.from_numpy(pos)[None], mask)[0]
    for b, anchor in enumerate(anchors):
        expected = reference_block(ref, model, features, tokens, int(anchor))
        torch.testing.assert_close(packed[b * BLOCK : (b + 1) * BLOCK], expected, rtol=1e-5, atol=1e-5)


def test_reduced_vocab_checkpoint_round_trips_with_d2t_offsets(tmp_path):
    d2t = torch.tensor([0, 3, 7, 50, 119])
    model = random_drafter(small_config(draft_vocab=5), d2t=d2t)
    path = model.save_checkpoint(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(path / "model.safetensors"))
    torch.testing.assert_close(saved["d2t"] + torch.arange(5), d2t)  # offsets, as llama.cpp's converter reads them
    assert saved["t2d"].sum() == 5 and saved["t2d"][119]
    torch.testing.assert_close(saved["lm_head.weight"], model.embed[d2t])
    again = Drafter.load_checkpoint(path, model.embed)
    torch.testing.assert_close(again.d2t, d2t)
    hidden = torch.randn(2, HIDDEN)
    torch.testing.assert_close(again.logits(hidden), (hidden @ model.embed.T)[:, d2t])


def test_target_layer_ids_spread_like_build_target_layer_ids():
    from dflash.model import build_target_layer_ids

    assert target_layer_ids(30, 5) == build_target_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert target_layer_ids(30, 1) == build_target_layer_ids(30, 1) == [15]

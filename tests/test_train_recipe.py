"""The training recipe against hand-computed small cases: anchors, block mask, labels, weights, loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dflash_gguf.train.recipe import (
    IGNORE,
    attention_mask,
    block_inputs,
    block_labels,
    default_gamma,
    expected_acceptance,
    slot_weights,
    valid_anchors,
    weighted_loss,
)

T, F = True, False


def test_mask_block_sees_context_before_its_anchor_and_only_itself():
    # 4 context rows, blocks of 2 anchored at 1 and 3
    mask = attention_mask(n_context=4, context_len=4, anchors=np.array([1, 3]), block_size=2).numpy()
    expected = np.array(
        [
            # ctx0 ctx1 ctx2 ctx3 | b0s0 b0s1 b1s0 b1s1
            [T, F, F, F, T, T, F, F],  # block 0 (anchor 1) slot 0
            [T, F, F, F, T, T, F, F],  # block 0 slot 1
            [T, T, T, F, F, F, T, T],  # block 1 (anchor 3) slot 0
            [T, T, T, F, F, F, T, T],  # block 1 slot 1
        ]
    )
    np.testing.assert_array_equal(mask, expected)


def test_mask_hides_padded_context_rows():
    # a sequence with 2 real context rows in a batch padded to 4
    mask = attention_mask(n_context=4, context_len=2, anchors=np.array([3]), block_size=2).numpy()
    np.testing.assert_array_equal(mask[:, :4], [[T, T, F, F], [T, T, F, F]])


def test_block_inputs_are_anchor_token_then_masks_at_consecutive_positions():
    tokens = np.array([10, 11, 12, 13, 14, 15])
    ids, pos = block_inputs(tokens, np.array([1, 4]), block_size=3, mask_token_id=99)
    np.testing.assert_array_equal(ids, [11, 99, 99, 14, 99, 99])
    np.testing.assert_array_equal(pos, [1, 2, 3, 4, 5, 6])


def test_labels_are_same_position_tokens_slot0_unscored_and_end_ignored():
    tokens = np.array([10, 11, 12, 13, 14])
    labels = block_labels(tokens, np.array([1, 3]), block_size=3)
    np.testing.assert_array_equal(labels, [IGNORE, 12, 13, IGNORE, 14, IGNORE])


def test_labels_map_to_draft_rows_and_ignore_tokens_outside_the_draft_vocab():
    tokens = np.array([5, 6, 7, 8])
    t2d = np.full(10, -1)
    t2d[[6, 8]] = [0, 1]  # draft vocab = {6, 8}
    labels = block_labels(tokens, np.array([0]), block_size=4, t2d=t2d)
    np.testing.assert_array_equal(labels, [IGNORE, 0, IGNORE, 1])


def test_slot_weights_decay_from_slot_one():
    w = slot_weights(4, gamma=7.0)
    np.testing.assert_allclose(w, [0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])
    assert default_gamma(16) == 7.0


def test_valid_anchors_need_context_and_a_later_token():
    # 6 tokens, features for the first 5, response starts at 3: anchors 3 and 4
    np.testing.assert_array_equal(valid_anchors(6, 5, 3), [3, 4])
    assert len(valid_anchors(4, 3, 3)) == 0


def test_weighted_loss_matches_hand_computation():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    labels = torch.tensor([0, 0, IGNORE])
    weights = torch.tensor([1.0, 0.5, 3.0])
    loss, acc = weighted_loss(logits, labels, weights)
    ce0 = -math.log(math.exp(2) / (math.exp(2) + 1))
    ce1 = -math.log(1 / (1 + math.e))
    assert loss.item() == pytest.approx((ce0 * 1.0 + ce1 * 0.5) / 1.5, rel=1e-6)
    assert acc.item() == pytest.approx(0.5)


def test_expected_acceptance_counts_leading_hits_plus_bonus():
    hits = np.array([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    assert expected_acceptance(hits) == pytest.approx(1 + (2 + 0 + 4) / 3)

"""Loss scope: the masked and the full-sequence loss differ on a toy batch, and each equals a hand computation."""

import math

import numpy as np
import pytest

from gemport.step import loss_scopes, masked_cross_entropy

# One packed row: segment 1 = tokens 0..3, segment 2 = tokens 4..5, then padding.
TOKENS = np.array([[2, 0, 1, 2, 2, 1, 0]], np.int32)
SEGMENT_IDS = np.array([[1, 1, 1, 1, 2, 2, 0]], np.int32)
LOSS_MASK = np.array([[0, 0, 1, 1, 0, 1, 0]], bool)
LOGITS = np.array([[
    [-3.0, 0.0, 2.0],  # predicts token 1 (= 0), badly: only the full-sequence loss sees it
    [0.0, 1.0, 0.5],   # predicts token 2 (= 1)
    [1.0, 1.0, 3.0],   # predicts token 3 (= 2)
    [0.0, 0.0, 0.0],   # would predict token 4 across the boundary: never scored
    [-2.0, 4.0, 0.0],  # predicts token 5 (= 1)
    [5.0, 0.0, 0.0],   # would predict padding: never scored
    [0.0, 0.0, 0.0],
]], np.float32)


def nll(row, target):
    return math.log(sum(math.exp(x) for x in row)) - row[target]


def test_masked_and_full_sequence_losses_match_hand_computation():
    logits = LOGITS[0].tolist()
    masked = (nll(logits[1], 1) + nll(logits[2], 2) + nll(logits[4], 1)) / 3
    full = (nll(logits[0], 0) + nll(logits[1], 1) + nll(logits[2], 2) + nll(logits[4], 1)) / 4
    scopes = loss_scopes(LOGITS, TOKENS, LOSS_MASK, SEGMENT_IDS)
    assert int(scopes["masked_targets"]) == 3 and int(scopes["full_sequence_targets"]) == 4
    assert float(scopes["masked"]) == pytest.approx(masked, rel=1e-6)
    assert float(scopes["full_sequence"]) == pytest.approx(full, rel=1e-6)
    assert full > masked + 1.0
    assert float(masked_cross_entropy(LOGITS, TOKENS, LOSS_MASK)) == pytest.approx(masked, rel=1e-6)


def test_loss_is_normalised_by_targets_of_the_whole_batch():
    logits = np.concatenate([LOGITS, LOGITS])
    tokens = np.concatenate([TOKENS, TOKENS])
    loss_mask = np.concatenate([LOSS_MASK, np.zeros_like(LOSS_MASK)])
    loss_mask[1, 2] = True  # row 1 trains one target, row 0 three: a per-row mean would weigh them equally
    rows = LOGITS[0].tolist()
    expected = (nll(rows[1], 1) + nll(rows[2], 2) + nll(rows[4], 1) + nll(rows[1], 1)) / 4
    assert float(masked_cross_entropy(logits, tokens, loss_mask)) == pytest.approx(expected, rel=1e-6)


def test_no_target_gives_zero_and_says_so():
    scopes = loss_scopes(LOGITS, TOKENS, np.zeros_like(LOSS_MASK), SEGMENT_IDS)
    assert float(scopes["masked"]) == 0.0 and int(scopes["masked_targets"]) == 0

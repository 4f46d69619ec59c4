"""Packed rows: every example once and intact, positions per segment, no target across a boundary."""

from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gemport.data import attention_mask, pack, tunix_inputs

from gemport.step import masked_cross_entropy
from gemport.errors import MaskError


@st.composite
def batches(draw):
    seq_len = draw(st.integers(2, 48))
    count = draw(st.integers(0, 30))
    tokens, loss_mask = [], []
    for _ in range(count):
        n = draw(st.integers(1, seq_len))
        tokens.append(np.array(draw(st.lists(st.integers(1, 500), min_size=n, max_size=n)), np.int32))
        loss_mask.append(np.array([False] + draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1))))
    return tokens, loss_mask, seq_len


def segments_of(packed):
    """Every (row, segment id) of the packed arrays as (tokens, loss_mask, positions) tuples."""
    out = []
    for row in range(packed["tokens"].shape[0]):
        ids = packed["segment_ids"][row]
        for segment in range(1, ids.max(initial=0) + 1):
            at = ids == segment
            out.append(tuple(tuple(packed[k][row][at].tolist()) for k in ("tokens", "loss_mask", "positions")))
    return out


def reference_fills(lengths, seq_len):
    """Best fit decreasing, the slow obvious way: the sorted fill of every row."""
    fills = []
    for length in sorted(lengths, reverse=True):
        fitting = [r for r, f in enumerate(fills) if f + length <= seq_len]
        if fitting:
            fills[max(fitting, key=lambda r: fills[r])] += length
        else:
            fills.append(length)
    return sorted(fills)


@settings(max_examples=100, deadline=None)
@given(batches())
def test_packing_properties(batch):
    tokens, loss_mask, seq_len = batch
    snapshot = [t.copy() for t in tokens], [m.copy() for m in loss_mask]
    packed = pack(list(zip(tokens, loss_mask)), seq_len)
    rows = packed["tokens"].shape[0]
    assert {k: (v.shape, v.dtype) for k, v in packed.items()} == {
        "tokens": ((rows, seq_len), np.int32), "loss_mask": ((rows, seq_len), bool),
        "segment_ids": ((rows, seq_len), np.int32), "positions": ((rows, seq_len), np.int32),
    }
    # Every example appears once, intact, with its mask, and its positions count from 0.
    segments = segments_of(packed)
    assert Counter(s[:2] for s in segments) == Counter((tuple(t.tolist()), tuple(m.tolist())) for t, m in zip(*snapshot))
    assert all(s[2] == tuple(range(len(s[0]))) for s in segments)
    # Segments are numbered 1.. from the left of each row, padding (0) only at the tail.
    ids = packed["segment_ids"]
    assert (np.diff(ids, axis=1)[ids[:, 1:] != 0] >= 0).all() and (ids[:, 0] == 1).all()
    assert all(np.array_equal(np.unique(r[r > 0]), np.arange(1, r.max() + 1)) for r in ids)
    assert not ((ids[:, :-1] == 0) & (ids[:, 1:] != 0)).any()
    # Padding is never trained, and no target is predicted from another segment.
    padding = ids == 0
    assert not packed["loss_mask"][padding].any() and not packed["tokens"][padding].any()
    assert not packed["positions"][padding].any()
    assert not packed["loss_mask"][:, 0].any()
    crossing = packed["loss_mask"][:, 1:] & (ids[:, 1:] != ids[:, :-1])
    assert not crossing.any()
    # Best fit decreasing, and the inputs are untouched.
    assert sorted((~padding).sum(axis=1).tolist()) == reference_fills([len(t) for t in tokens], seq_len)
    assert all(np.array_equal(a, b) for a, b in zip(tokens + loss_mask, snapshot[0] + snapshot[1]))


def test_pack_places_longest_first_into_the_tightest_row():
    tokens = [np.full(n, n, np.int32) for n in (3, 5, 2, 4)]
    loss_mask = [np.arange(n) > 0 for n in (3, 5, 2, 4)]
    packed = pack(list(zip(tokens, loss_mask)), seq_len=8)
    assert packed["tokens"].tolist() == [[5, 5, 5, 5, 5, 3, 3, 3], [4, 4, 4, 4, 2, 2, 0, 0]]
    assert packed["segment_ids"].tolist() == [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 2, 2, 0, 0]]
    assert packed["positions"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 2, 3, 0, 1, 0, 0]]
    assert packed["loss_mask"].astype(int).tolist() == [[0, 1, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 1, 0, 0]]


@pytest.mark.parametrize("tokens, loss_mask, match", [
    ([np.ones(9, np.int32)], [np.zeros(9, bool)], "9 tokens; need 1..8"),
    ([np.ones(0, np.int32)], [np.zeros(0, bool)], "0 tokens"),
    ([np.ones(3, np.int32)], [np.zeros(2, bool)], "2 entries for 3 tokens"),
    ([np.ones(3, np.int32)], [np.array([True, False, False])], "first token"),
])
def test_pack_rejects_bad_examples(tokens, loss_mask, match):
    with pytest.raises(MaskError, match=match):
        pack(list(zip(tokens, loss_mask)), seq_len=8)


def test_attention_mask_is_causal_and_block_diagonal():
    segment_ids = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], np.int32)
    got = np.asarray(attention_mask(segment_ids))
    for b, q, k in np.ndindex(got.shape):
        assert got[b, q, k] == (k <= q and segment_ids[b, q] == segment_ids[b, k])
    assert got.any(axis=-1).all()


def test_tunix_inputs_feed_tunix_default_loss():
    peft_trainer = pytest.importorskip("tunix.sft.peft_trainer")
    tokens = [np.array([2, 7, 8, 9], np.int32), np.array([2, 5, 6], np.int32)]
    loss_mask = [np.array([0, 0, 1, 1], bool), np.array([0, 1, 1], bool)]
    packed = pack(list(zip(tokens, loss_mask)), seq_len=8)
    inputs = tunix_inputs(**packed)
    assert inputs["attention_mask"].shape == (1, 8, 8) and inputs["input_mask"].dtype == jnp.bool_
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 16)), jnp.float32)
    seen = {}

    def model(input_tokens, positions, cache, attention_mask):
        seen.update(positions=positions, attention_mask=attention_mask)
        return logits, cache

    loss = peft_trainer._default_loss_fn(model, **inputs)
    assert np.array_equal(seen["positions"], [[0, 1, 2, 3, 0, 1, 2, 0]])
    assert np.array_equal(seen["attention_mask"], attention_mask(packed["segment_ids"]))
    np.testing.assert_allclose(loss, masked_cross_entropy(logits, packed["tokens"], packed["loss_mask"]), rtol=1e-6)

"""Batching without packing against TRL's DataCollatorForLanguageModeling (padded and padding-free)."""

import numpy as np
import pytest
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from gemport.data import pack, pad, padding_free

from gemport.step import summed_cross_entropy
from gemport.errors import MaskError

TOKENS = [np.array([5, 6, 7]), np.array([8, 9, 10, 11, 12]), np.array([13, 14])]
MASKS = [np.array([0, 1, 1], bool), np.array([0, 0, 1, 1, 1], bool), np.array([0, 1], bool)]
EXAMPLES = list(zip(TOKENS, MASKS))


def trl(padding_free, pad_to_multiple_of=None):
    collator = DataCollatorForLanguageModeling(pad_token_id=3, padding_free=padding_free,
                                               pad_to_multiple_of=pad_to_multiple_of)
    rows = [{"input_ids": t.tolist(), "labels": np.where(m, t, -100).tolist()} for t, m in zip(TOKENS, MASKS)]
    return {k: v.numpy() if hasattr(v, "numpy") else v for k, v in collator(rows).items()}


@pytest.mark.parametrize("multiple", [None, 4])
def test_pad_matches_trls_collator(multiple):
    expected = trl(False, multiple)
    rows = pad(EXAMPLES, pad_to_multiple_of=multiple, pad_id=3)
    np.testing.assert_array_equal(rows["tokens"], expected["input_ids"])
    np.testing.assert_array_equal(rows["loss_mask"], expected["labels"] != -100)
    np.testing.assert_array_equal(rows["segment_ids"], expected["attention_mask"])
    np.testing.assert_array_equal(rows["positions"][rows["segment_ids"] > 0],
                                  np.concatenate([np.arange(len(t)) for t in TOKENS]))
    assert pad(EXAMPLES, 8)["tokens"].shape == (3, 8)


@pytest.mark.parametrize("multiple", [None, 4])
def test_padding_free_matches_trls_collator(multiple):
    expected = trl(True, multiple)
    row = padding_free(EXAMPLES, pad_to_multiple_of=multiple, pad_id=3)
    np.testing.assert_array_equal(row["tokens"], expected["input_ids"])
    np.testing.assert_array_equal(row["loss_mask"], expected["labels"] != -100)
    np.testing.assert_array_equal(row["positions"], expected["position_ids"])
    assert row["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2, 2, 2, 3, 3] + [0] * (len(row["tokens"][0]) - 10)]


def test_rows_feed_the_same_loss_as_packed_rows():
    # One example per row and one row of all examples score the same targets.
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(1, 10, 16)).astype(np.float32)
    row = padding_free(EXAMPLES)
    rows = pad(EXAMPLES)
    per_row = np.zeros((3, 5, 16), np.float32)
    for i, (start, n) in enumerate([(0, 3), (3, 5), (8, 2)]):
        per_row[i, :n] = logits[0, start:start + n]
    a = summed_cross_entropy(logits, row["tokens"], row["loss_mask"])
    b = summed_cross_entropy(per_row, rows["tokens"], rows["loss_mask"])
    np.testing.assert_allclose(float(a[0]), float(b[0]), rtol=1e-6)
    assert int(a[1]) == int(b[1]) == 6


def test_bad_input_is_named():
    with pytest.raises(MaskError, match=r"examples\[1\] has 5 tokens"):
        pad(EXAMPLES, 4)
    with pytest.raises(MaskError, match=r"examples\[2\]: loss_mask has 1 entries for 2 tokens"):
        padding_free(EXAMPLES[:2] + [(TOKENS[2], np.array([0], bool))])
    with pytest.raises(MaskError, match=r"examples\[0\] is a ndarray; pass Examples or \(tokens, loss_mask\) pairs"):
        pad(TOKENS)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_makes_trls_bfd_rows_in_trls_order(seed):
    import datasets
    from trl.data_utils import pack_dataset

    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 33, 60)
    tokens = [np.arange(1, n + 1) + 100 * i for i, n in enumerate(lengths)]
    loss_mask = [np.arange(n) > 0 for n in lengths]
    packed = pack_dataset(datasets.Dataset.from_dict({"input_ids": [t.tolist() for t in tokens]}), 32, "bfd")
    rows = pack(list(zip(tokens, loss_mask)), 32)
    ours = [r[s > 0].tolist() for r, s in zip(rows["tokens"], rows["segment_ids"])]
    assert ours == packed["input_ids"]
    assert [np.bincount(s[s > 0])[1:].tolist() for s in rows["segment_ids"]] == packed["seq_lengths"]

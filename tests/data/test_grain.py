"""Masks built in a Grain pipeline pack correctly with Grain's own packers."""

from collections import Counter

import numpy as np
import pytest

from gemport.data import build, Gemma4, MaskPolicy, Truncation, tunix_inputs
from tiny_tokenizers import GEMMA4_CONTROL, char_tokenizer

grain = pytest.importorskip("grain")
from gemport.data.grain import MaskTransform, from_grain, has_target  # noqa: E402

TOKENIZER = char_tokenizer(GEMMA4_CONTROL)
WORDS = ["Hi", "Sure", "It is 4.", "x", "a longer answer"]  # 18 + user + answer tokens <= 63
CHATS = [
    [{"role": "user", "content": WORDS[i % 5]}, {"role": "assistant", "content": WORDS[(3 * i) % 5] * (1 + i % 2)}]
    for i in range(12)
] + [[{"role": "user", "content": "no answer"}], [{"role": "user", "content": "q"}, {"role": "assistant", "content": "y" * 80}]]
SEQ_LEN = 64


@pytest.mark.parametrize("packer", ["FirstFitPackIterDataset", "BestFitPackIterDataset"])
def test_grain_packers_keep_masks_and_boundaries(packer):
    policy, truncation = MaskPolicy(), Truncation(SEQ_LEN)
    transform = MaskTransform(TOKENIZER, Gemma4(), policy, truncation)
    dataset = (
        grain.MapDataset.source([{"messages": c} for c in CHATS])
        .map_with_index(transform)
        .filter(has_target)
        .to_iter_dataset()
    )
    packed = getattr(grain.experimental, packer)(
        dataset, length_struct={"tokens": SEQ_LEN, "loss_mask": SEQ_LEN}, num_packing_bins=3, shuffle_bins=False
    )
    rows = [from_grain(row) for row in packed]
    expected, report = build(CHATS, TOKENIZER, Gemma4(), policy, truncation)
    assert transform.report == report
    assert (report.kept, report.dropped_no_target, report.dropped_too_long) == (12, 1, 1)
    assert report.which == {"dropped_no_target": [12], "dropped_too_long": [13]}

    found = []
    for row in rows:
        ids, trained = row["segment_ids"], row["loss_mask"].astype(bool)
        assert not trained[ids == 0].any() and not trained[0]
        assert not (trained[1:] & (ids[1:] != ids[:-1])).any()
        for segment in range(1, ids.max() + 1):
            at = ids == segment
            assert row["positions"][at].tolist() == list(range(at.sum()))
            found.append((tuple(row["tokens"][at].tolist()), tuple(trained[at].tolist())))
    assert len(found) > len(rows)  # some rows hold several examples
    assert Counter(found) == Counter((tuple(e.tokens.tolist()), tuple(e.loss_mask.tolist())) for e in expected)


def test_dropped_example_maps_to_an_empty_record():
    transform = MaskTransform(TOKENIZER, Gemma4(), MaskPolicy(), Truncation(SEQ_LEN))
    record = transform.map({"messages": CHATS[-2], "id": "q7"})
    assert record["tokens"].shape == (0,) and not has_target(record)
    assert transform.report.dropped_no_target == 1 and transform.report.which == {"dropped_no_target": ["q7"]}
    assert np.array_equal(tunix_inputs(**from_grain({
        "tokens": np.ones((1, 4)), "loss_mask": np.zeros((1, 4), bool),
        "tokens_segment_ids": np.ones((1, 4)), "tokens_positions": np.arange(4)[None],
    }))["positions"], np.arange(4)[None])

"""The frame's GPU-side dataset: TRL's records as datasets holds them, without datasets pickling the table."""

import datasets
import pytest

from gemport.check.frame import Setup

from chats import chats

LAYOUTS = {
    "messages": chats(6),
    "prompt-completion": [{"prompt": [{"role": "user", "content": f"q{i}"}],
                           "completion": [{"role": "assistant", "content": f"a{i}"}]} for i in range(4)],
    "text": [{"text": f"row {i} " * (i + 1)} for i in range(3)],
    "preference": [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(3)],
}


def setup_of(records):
    return Setup(base_dir="unused", records=records, tokenizer=None, work=None, overrides={}, dtype="float32",
                 qlora=None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_dataset_is_datasets_own_of_the_records(layout, monkeypatch):
    records = LAYOUTS[layout]
    expected = datasets.Dataset.from_list(records)

    def unpicklable(*args, **kwargs):  # the TPU machine's failure: dill could not pickle the arrow table
        raise RuntimeError("datasets fingerprinted the table")

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", unpicklable)
    got = setup_of(records).dataset()
    assert got.features == expected.features
    assert got.to_list() == expected.to_list()
    assert got._fingerprint == setup_of([dict(r) for r in records]).dataset()._fingerprint
    assert got._fingerprint != setup_of(records[:-1]).dataset()._fingerprint

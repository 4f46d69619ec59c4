"""gemport.data's sample order against torch's RandomSampler and HF's Trainer dataloader (in test_train_step)."""

import numpy as np
import pytest
import torch
import transformers
from torch.utils.data import RandomSampler

from gemport.errors import RecipeError
from gemport.data import optimizer_steps, randperm, sample_order


@pytest.mark.parametrize("n, seed", [(0, 0), (1, 3), (2, 0), (10, 42), (1000, 7), (37, 2**33 + 5)])
def test_randperm_is_torchs(n, seed):
    expected = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    np.testing.assert_array_equal(randperm(n, seed), expected)


def test_random_order_is_the_seeded_sampler_of_each_epoch():
    for epoch in range(3):
        sampler = RandomSampler(range(25), generator=torch.Generator().manual_seed(11 + epoch))
        np.testing.assert_array_equal(sample_order(25, seed=11, epoch=epoch), list(sampler))
    np.testing.assert_array_equal(sample_order(5, seed=1, strategy="sequential"), np.arange(5))
    with pytest.raises(RecipeError, match="group_by_length"):
        sample_order(5, seed=1, strategy="group_by_length")


def test_steps_group_micro_batches_and_reseed_each_epoch():
    args = transformers.TrainingArguments(output_dir="unused", per_device_train_batch_size=2,
                                          gradient_accumulation_steps=3, num_train_epochs=2, seed=5, data_seed=9,
                                          report_to="none")
    steps = list(optimizer_steps(args, 9))
    # 5 micro-batches per epoch (the last of one row): steps of 3 and 2 micro-batches, twice.
    assert [(s.step, s.epoch, [len(m) for m in s.micro_batches]) for s in steps] == [
        (0, 0, [2, 2, 2]), (1, 0, [2, 1]), (2, 1, [2, 2, 2]), (3, 1, [2, 1])]
    for epoch in (0, 1):
        rows = np.concatenate([m for s in steps if s.epoch == epoch for m in s.micro_batches])
        np.testing.assert_array_equal(rows, randperm(9, 9 + epoch))  # data_seed wins over seed


def test_max_steps_and_drop_last():
    args = {"per_device_train_batch_size": 4, "max_steps": 5, "dataloader_drop_last": True, "seed": 0}
    steps = list(optimizer_steps(args, 10))
    assert len(steps) == 5 and all(len(s.micro_batches) == 1 and len(s.micro_batches[0]) == 4 for s in steps)
    assert [s.epoch for s in steps] == [0, 0, 1, 1, 2]
    with pytest.raises(RecipeError, match="no batch"):
        list(optimizer_steps({**args, "per_device_train_batch_size": 11}, 10))
    with pytest.raises(RecipeError, match="gradient_accumulation_steps"):
        list(optimizer_steps({"gradient_accumulation_steps": 0}, 10))

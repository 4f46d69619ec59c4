"""Training past one host: each process's rows of HF's batches, and (multihost_child.py) runs under jax.distributed.

The split is tested in-process on the 8 simulated devices, grouped into two "hosts" of 4 as jax.distributed
groups them: the hosts' rows are disjoint, contiguous, and together the single-process batch, row for row.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gemport import masks, train
from gemport.errors import OptimizerConfigError
from gemport.train.distributed import batch_sharding, device_rows, global_batch, process_rows, process_step
from test_train_sft import CONFIG, chats, tokenizer

HOSTS = 2


def hosts(mesh):
    """The mesh's devices as jax.distributed would give them to 2 processes of 4 (in device order)."""
    devices = list(mesh.devices.flat)
    per = len(devices) // HOSTS
    return [devices[i * per:(i + 1) * per] for i in range(HOSTS)]


def meshes():
    devices = jax.devices()
    return [jax.make_mesh((8, 1), ("fsdp", "tp"), devices=devices),
            jax.make_mesh((2, 4), ("fsdp", "tp"), devices=devices)]


@pytest.mark.parametrize("mesh", meshes(), ids=["fsdp8", "fsdp2_tp4"])
def test_each_host_holds_one_range_of_rows(mesh):
    sharding = batch_sharding(mesh)
    shape = (2, 8, 12)
    parts = [device_rows(sharding, shape, group) for group in hosts(mesh)]
    assert parts == [slice(0, 4), slice(4, 8)]
    assert process_rows(sharding, shape) == slice(0, 8)  # one process here: all of them


def test_rows_that_are_not_one_range_are_refused():
    mesh = meshes()[1]
    # Rows over (tp, fsdp): the first host's devices (fsdp 0, every tp) hold rows 0, 2, 4, 6.
    sharding = NamedSharding(mesh, PartitionSpec(None, ("tp", "fsdp"), None))
    with pytest.raises(OptimizerConfigError, match=r"rows \[0, 2, 4, 6\] of 8"):
        device_rows(sharding, (2, 8, 12), hosts(mesh)[0])


def packed_rows(n=23, seed=1):
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(1, 96, int(k)).astype(np.int32) for k in rng.integers(4, 13, n)]
    return masks.pack([(t, np.arange(len(t)) >= len(t) // 2) for t in tokens], 12)


def test_hosts_rows_are_the_single_process_batches():
    rows = packed_rows()
    args = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_train_epochs=2, seed=5)
    mesh = meshes()[0]
    sharding = batch_sharding(mesh)
    steps = list(train.optimizer_steps(args, len(rows["tokens"])))
    assert len(steps[-1].micro_batches[-1]) < 8  # a short last micro-batch: one host gets fewer rows, or none

    def batch(step, count):
        return train.stack([{k: v[m] for k, v in rows.items()} for m in step.micro_batches], accumulation=2, rows=count)

    for step in steps:
        whole = batch(step, 8)
        parts = []
        for group in hosts(mesh):
            mine = device_rows(sharding, whole["tokens"].shape, group)
            parts.append(batch(process_step(step, mine), mine.stop - mine.start))
        for k in whole:
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts], axis=1), whole[k], err_msg=k)
        joined = global_batch(whole, sharding, 8)  # one process: its local rows are the global batch
        assert joined["tokens"].sharding == sharding
        np.testing.assert_array_equal(np.asarray(joined["tokens"]), whole["tokens"])


@pytest.mark.parametrize("layout", [{}, {"packing": False}])
def test_sft_pipeline_lays_out_only_a_hosts_rows(layout):
    config = {**CONFIG, **layout, "per_device_train_batch_size": 4, "max_steps": 5}
    pipeline = train.from_sft_config(config, tokenizer())
    examples, _ = pipeline.examples(chats(), tokenizer(), progress=False)
    whole = list(pipeline.batches(examples))
    parts = [list(pipeline.batches(examples, rows=rows)) for rows in (slice(0, 2), slice(2, 4))]
    assert len(whole) == len(parts[0]) == len(parts[1]) == 5
    for (step, batch), (step0, part0), (step1, part1) in zip(whole, *parts):
        assert part0["tokens"].shape == (2, 2, batch["tokens"].shape[-1])
        for a, m in enumerate(step.micro_batches):
            np.testing.assert_array_equal(np.concatenate([step0.micro_batches[a], step1.micro_batches[a]]), m)
        for k in batch:
            np.testing.assert_array_equal(np.concatenate([part0[k], part1[k]], axis=1), batch[k], err_msg=k)
    free = train.from_sft_config({**config, "packing": False, "padding_free": True}, tokenizer())
    with pytest.raises(OptimizerConfigError, match="padding_free"):
        next(free.batches(examples, rows=slice(0, 1)))

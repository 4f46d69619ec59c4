"""Training data prepared once (every core), kept beside the outputs, read memory-mapped by every later run.

Beyond 1000 examples TRL packs 1000 at a time within ``dataset_num_proc`` shards: the rows of TRL's real
SFTTrainer are gemport's, from memory and from the cache, prepared by two worker processes. The cache is keyed by
what changes the examples (a file's content, not its path or mtime), survives nothing half-written, and names a bad
record by its file and line from inside a worker.
"""

import json
import multiprocessing.pool
import multiprocessing.util
import os
import shutil
import time

import datasets
import numpy as np
import pytest
import transformers
from trl import SFTConfig, SFTTrainer

from gemport.data import from_sft_config
from gemport.data import cache, workers
from gemport.data.prepared import MANIFEST, Column, load
from gemport.errors import MaskError
from chats import chats, tokenizer

CONFIG = dict(assistant_only_loss=True, packing=True, max_length=128, per_device_train_batch_size=2,
              gradient_accumulation_steps=2, max_steps=4, report_to="none", use_cpu=True, bf16=False)
N = 2600  # two parts of workers.PART_SIZE records, three packing batches of 1000


def rows_of(units):
    return [row[segments > 0].tolist() for row, segments in zip(units["tokens"], units["segment_ids"])]


@pytest.mark.parametrize("num_proc", [None, 2])
def test_packed_rows_beyond_1000_examples_are_trls(hf_checkpoint, tmp_path, num_proc):
    _, base = hf_checkpoint("gemma4_mesh")
    config = {**CONFIG, "dataset_num_proc": num_proc}
    data = datasets.Dataset.from_list(chats(N))
    trainer = SFTTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(base),
                         args=SFTConfig(output_dir=str(tmp_path / "trl"), **config), train_dataset=data,
                         processing_class=tokenizer())
    expected = trainer.train_dataset["input_ids"]
    pipeline = from_sft_config(config, tokenizer())
    examples, _ = pipeline.examples(data, tokenizer(), progress=False)
    assert rows_of(pipeline.units(examples)) == expected
    prepared = pipeline.prepared(data, tokenizer(), root=tmp_path / "cache", workers=2, progress=False)
    assert prepared.placement.rows == len(expected)
    assert rows_of(pipeline.units(prepared.examples)) == expected
    # One packing of all 2600 examples at once would give other rows.
    from gemport.data import pack

    assert rows_of(pack(examples, 128)) != expected


def test_the_workers_end_on_their_own_once_every_part_is_back(tmp_path, monkeypatch):
    """A pool's terminate() stops its workers with SIGTERM, which libtpu's handler (loaded on every TPU host, and in
    this suite by the compile-only tests) answers in each forked worker with a stack dump, or a segfault where the
    signal lands in malloc: with every part back, the workers leave on the pool's close, exit code 0."""
    pools = []
    init = multiprocessing.pool.Pool.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        pools.append(self)

    monkeypatch.setattr(multiprocessing.pool.Pool, "__init__", recorded)
    # A worker leaving takes a second (a busy machine's timing), so a pool that does not wait for it stops it.
    leave = multiprocessing.util._exit_function
    monkeypatch.setattr(multiprocessing.util, "_exit_function", lambda *a, **k: (time.sleep(1), leave(*a, **k)))
    prepared = from_sft_config(CONFIG, tokenizer()).prepared(chats(N), tokenizer(), root=tmp_path, workers=2,
                                                             progress=False)
    assert len(prepared.examples) > 0
    (pool,) = pools
    assert [worker.exitcode for worker in pool._pool] == [0, 0]  # -15: stopped by SIGTERM


def test_cached_batches_are_the_batches_laid_out_in_memory(tmp_path):
    for layout in ({}, {"packing": False}, {"packing": False, "padding_free": True}):
        pipeline = from_sft_config({**CONFIG, **layout, "max_steps": 30}, tokenizer())
        examples, report = pipeline.examples(chats(N), tokenizer(), progress=False)
        prepared = pipeline.prepared(chats(N), tokenizer(), root=tmp_path, workers=2, progress=False)
        assert repr(prepared.report) == repr(report) and len(prepared.examples) == len(examples)
        lazy = pipeline.steps(prepared.examples, placement=prepared.placement)
        for s, (step, batch) in enumerate(pipeline.batches(examples)):
            assert [m.tolist() for m in lazy.step(s).micro_batches] == [m.tolist() for m in step.micro_batches]
            for k in batch:
                np.testing.assert_array_equal(lazy[s][k], batch[k], err_msg=f"{layout} step {s} {k}")
            assert lazy.targets(s) == int(batch["loss_mask"][:, :, 1:].sum())
            assert lazy.tokens(s) == int((batch["segment_ids"] > 0).sum())


def test_a_second_run_reads_the_cache_and_tokenizes_nothing(tmp_path, monkeypatch):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chats(50)))
    pipeline = from_sft_config(CONFIG, tokenizer())
    first = pipeline.prepared(data, tokenizer(), root=tmp_path / "cache", progress=False)
    assert isinstance(first.examples.tokens, Column) and (first.path / MANIFEST).is_file()

    def never(*args, **kwargs):
        raise AssertionError("prepared again")

    monkeypatch.setattr(workers, "prepare_part", never)
    again = pipeline.prepared(data, tokenizer(), root=tmp_path / "cache", progress=False)
    assert again.path == first.path and again.examples.digest == first.examples.digest
    # A copy elsewhere (another path, another mtime) is the same data: same key. Its content is what counts.
    time.sleep(0.01)
    shutil.copy(data, tmp_path / "copy.jsonl")
    assert pipeline.prepared(tmp_path / "copy.jsonl", tokenizer(), root=tmp_path / "cache",
                             progress=False).path == first.path
    monkeypatch.undo()
    keys = {first.path.name}
    (tmp_path / "copy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(50, seed=1)))
    for source, config, tok in [(tmp_path / "copy.jsonl", CONFIG, tokenizer()),  # other records
                                (data, {**CONFIG, "max_length": 160}, tokenizer()),  # other packing
                                (data, {**CONFIG, "dataset_num_proc": 3}, tokenizer()),
                                (data, {**CONFIG, "assistant_only_loss": False}, tokenizer())]:  # other masks
        keys.add(from_sft_config(config, tok).prepared(source, tok, root=tmp_path / "cache", progress=False).path.name)
    other = tokenizer()
    other.add_tokens(["<extra>"])
    keys.add(from_sft_config(CONFIG, other).prepared(data, other, root=tmp_path / "cache", progress=False).path.name)
    assert len(keys) == 6
    # Same padded examples whatever the layout without packing: one preparation.
    unpacked = {from_sft_config({**CONFIG, **layout}, tokenizer()).prepared(data, tokenizer(), root=tmp_path / "cache",
                                                                           progress=False).path
                for layout in ({"packing": False}, {"packing": False, "padding_free": True})}
    assert len(unpacked) == 1


def test_an_interrupted_preparation_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    pipeline = from_sft_config(CONFIG, tokenizer())
    calls = []
    prepare = workers.prepare_part

    def interrupted(job, part):
        calls.append(part.first)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return prepare(job, part)

    monkeypatch.setattr(workers, "prepare_part", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline.prepared(chats(N), tokenizer(), root=tmp_path, workers=1, progress=False)
    assert list(tmp_path.iterdir()) == []
    # A folder a killed process left without its manifest is not read, and is prepared anew.
    monkeypatch.undo()
    done = pipeline.prepared(chats(20), tokenizer(), root=tmp_path, progress=False)
    (done.path / MANIFEST).unlink()
    with pytest.raises(MaskError, match="not a complete gemport data preparation"):
        load(done.path)
    shutil.rmtree(done.path)
    assert pipeline.prepared(chats(20), tokenizer(), root=tmp_path, progress=False).path == done.path


def test_a_worker_names_the_bad_record_by_file_and_line(tmp_path):
    lines = [json.dumps(r) for r in chats(N)]
    lines[2500] = '{"messages": [{"role": "user", "content": "hi"}'
    lines.insert(100, "")  # a blank line: skipped, still counted in line numbers
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    pipeline = from_sft_config(CONFIG, tokenizer())
    with pytest.raises(MaskError, match=r"bad\.jsonl:2502: not valid JSON"):
        pipeline.prepared(tmp_path / "bad.jsonl", tokenizer(), root=tmp_path / "cache", workers=2, progress=False)
    assert not (tmp_path / "cache").exists() or not any(p.name[0] != "." and p.name != cache.STAMPS
                                                        for p in (tmp_path / "cache").iterdir())


def test_the_report_names_dropped_records_across_parts(tmp_path):
    records = chats(N)
    long = {"messages": [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "y"}]}
    records[5], records[2300] = long, {**long, "id": "far"}
    pipeline = from_sft_config({**CONFIG, "packing": False, "max_length": 128}, tokenizer())
    _, report = pipeline.examples(records, tokenizer(), progress=False)
    prepared = pipeline.prepared(records, tokenizer(), root=tmp_path, workers=2, progress=False)
    assert prepared.report.which == report.which == {"dropped_no_target": [5, "far"]}
    assert len(prepared.examples) == N - 2
    assert os.path.getsize(prepared.path / "tokens.npy") == 128 + 4 * prepared.examples.offsets[-1]

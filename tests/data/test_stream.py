"""A streamed dataset (an IterableDataset: ``dataset_streaming``) trained as TRL's SFTTrainer trains it.

TRL 1.16 prepares a stream lazily (packing 1000 examples at a time) and transformers 5.12's Trainer takes it
without a sampler, in stream order, reading it again from its start for each pass, and needs ``max_steps``. The
rows TRL's real SFTTrainer feeds a tiny Gemma 4, micro-batch by micro-batch and step by step, are gemport's
(``data.stream.StreamBatches``), packed and padded; where a pass ends short of a step, TRL adds the left-over
micro-batches to the next pass's first step, which gemport skips (and says so). An SFTRun on a stream stopped by
SIGTERM and run again continues exactly.
"""

import json
import os
import signal
import warnings

import datasets
import jax
import numpy as np
import pytest
import transformers
from trl import SFTConfig, SFTTrainer

from gemport import SFTRun
from gemport.errors import RecipeError
from gemport.data import from_sft_config
from gemport.data.stream import Stream, StreamBatches
from gemport.mesh import make_mesh
from gemport.run.outputs import HFOutputs
from gemport.run.trainer import micro_batches
from gemport.specs import GemmaSpec
from chats import chats, tokenizer

CONFIG = dict(assistant_only_loss=True, max_length=128, per_device_train_batch_size=2, gradient_accumulation_steps=2,
              max_steps=5, learning_rate=5e-3, seed=3, logging_steps=1, report_to="none", save_strategy="no",
              use_cpu=True, bf16=False)


def stream(n):
    return datasets.Dataset.from_list(chats(n)).to_iterable_dataset()


def fed_by_trl(base, tmp_path, config, n):
    """The micro-batches TRL's SFTTrainer trains on a stream of ``chats(n)``, by optimizer step: each a list of
    examples (tokens, trained flags), and its log history."""
    fed: dict[int, list[list[tuple[list[int], list[bool]]]]] = {}

    class Recording(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            fed.setdefault(self.state.global_step, []).append(trl_examples(inputs))
            return super().training_step(model, inputs, num_items_in_batch)

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype="float32", attn_implementation="eager")
    trainer = Recording(model=model, args=SFTConfig(output_dir=str(tmp_path / "trl"), **config),
                        train_dataset=stream(n), processing_class=tokenizer())
    trainer.train()
    return [fed[s] for s in sorted(fed)], trainer


def trl_examples(inputs):
    """A TRL micro-batch's examples: padding-free rows split where position_ids restart, padded rows by their
    attention mask."""
    ids, labels = inputs["input_ids"].numpy(), inputs["labels"].numpy()
    out = []
    if "position_ids" in inputs and ids.shape[0] == 1:
        starts = np.flatnonzero(inputs["position_ids"].numpy()[0] == 0).tolist() + [ids.shape[1]]
        for a, b in zip(starts, starts[1:]):
            out.append((ids[0, a:b].tolist(), (labels[0, a:b] != -100).tolist()))
        return out
    for row, label, mask in zip(ids, labels, inputs["attention_mask"].numpy()):
        out.append((row[mask > 0].tolist(), (label[mask > 0] != -100).tolist()))
    return out


def gemport_examples(micro):
    """A gemport micro-batch's examples, row by row, segment by segment."""
    out = []
    for tokens, mask, segments in zip(micro["tokens"], micro["loss_mask"], micro["segment_ids"]):
        for s in range(1, int(segments.max(initial=0)) + 1):
            out.append((tokens[segments == s].tolist(), mask[segments == s].tolist()))
    return out


def gemport_steps(batches):
    return [[gemport_examples(batches.micro(s, a)) for a in range(batches.accumulation)
             if batches.micro(s, a)["segment_ids"].any()] for s in range(len(batches))]


@pytest.mark.parametrize("layout, n", [({"packing": True}, 11), ({"packing": False}, 12)])
def test_a_stream_trains_trls_rows_pass_after_pass(hf_checkpoint, tmp_path, layout, n):
    """11 chats pack into 7 rows (micro-batches of 2, 2, 2, 1: two whole steps a pass); 12 chats padded are 6
    micro-batches (three steps a pass). 5 steps read the stream 2 or 3 times, in stream order each time."""
    _, base = hf_checkpoint("gemma4_mesh")
    config = {**CONFIG, **layout}
    trl_steps, trainer = fed_by_trl(base, tmp_path, config, n)
    batches = StreamBatches(from_sft_config(config, tokenizer()), stream(n), tokenizer())
    ours = gemport_steps(batches)
    assert ours == trl_steps and len(ours) == 5 and all(len(step) == 2 for step in ours)
    assert sum(len(micro) for micro in ours[0]) >= 4  # two micro-batches of examples (more, packed)
    epochs = [e["epoch"] for e in trainer.state.log_history if "loss" in e]
    np.testing.assert_allclose([batches.plan.epochs()[s] for s in range(len(batches))], epochs, rtol=1e-12)
    if layout["packing"]:  # TRL's packed stream, row by row: the units gemport's micro-batches take
        rows = [r["input_ids"] for r in trainer.train_dataset]
        ours = [row[0] for step in gemport_steps(batches)[:2] for micro in step for row in micro]
        assert [t for r in rows for t in r] == [t for row in ours for t in row]


def test_a_pass_short_of_a_step_is_skipped_where_trl_adds_it_to_the_next(hf_checkpoint, tmp_path):
    """10 chats padded: 5 micro-batches a pass, two steps of 2 and one left over. TRL trains the left-over one
    with the next pass's first step (3 micro-batches); gemport's step has the 2, and warns."""
    _, base = hf_checkpoint("gemma4_mesh")
    config = {**CONFIG, "packing": False}
    trl_steps, _ = fed_by_trl(base, tmp_path, config, 10)
    batches = StreamBatches(from_sft_config(config, tokenizer()), stream(10), tokenizer())
    with pytest.warns(UserWarning, match="ends with 1 micro-batches.*skipped"):
        ours = gemport_steps(batches)
    assert [len(s) for s in trl_steps] == [2, 2, 3, 2, 3] and [len(s) for s in ours] == [2] * 5
    left_over = [(e.tokens.tolist(), e.loss_mask.tolist()) for e in batches.head[8:10]]  # the pass's 5th
    assert trl_steps[2][0] == trl_steps[4][0] == left_over
    assert trl_steps[2][1:] == ours[2] and trl_steps[4][1:] == ours[4]
    assert [trl_steps[s] for s in (0, 1, 3)] == [ours[s] for s in (0, 1, 3)]
    assert all(len(micro) == 2 and all(len(tokens) > 5 for tokens, _ in micro) for step in ours for micro in step)


def test_a_stream_needs_max_steps_and_max_length():
    pipeline = from_sft_config({**CONFIG, "max_steps": -1}, tokenizer())
    with pytest.raises(RecipeError, match="no length: set max_steps"):
        StreamBatches(pipeline, Stream(chats(4)), tokenizer())
    pipeline = from_sft_config({**CONFIG, "packing": False, "max_length": None}, tokenizer())
    with pytest.raises(RecipeError, match="set max_length"):
        StreamBatches(pipeline, Stream(chats(4)), tokenizer())
    pipeline = from_sft_config({**CONFIG, "per_device_train_batch_size": 8}, tokenizer())
    with pytest.warns(UserWarning), pytest.raises(RecipeError, match="fewer than one step"):
        StreamBatches(pipeline, Stream(chats(4)), tokenizer())[0]


def test_a_resumed_reader_builds_only_what_it_trains():
    """Tunix passes over the micro-batches a checkpoint consumed: they are empty, and the rest are those of an
    uninterrupted read, from a stream read again from its start."""
    pipeline = from_sft_config(CONFIG, tokenizer())
    whole = micro_batches(StreamBatches(pipeline, stream(11), tokenizer()))
    resumed = micro_batches(StreamBatches(pipeline, stream(11), tokenizer()), skip=6)
    assert all(resumed[i] == {} for i in range(6))
    for i in range(6, len(whole)):
        assert resumed[i].keys() == whole[i].keys()
        for k in whole[i]:
            np.testing.assert_array_equal(resumed[i][k], whole[i][k], err_msg=f"{i} {k}")


def test_an_sft_run_on_a_stream_stopped_and_run_again_continues_exactly(hf_checkpoint, tmp_path, monkeypatch):
    _, base = hf_checkpoint("gemma4_mesh")
    mesh = make_mesh(GemmaSpec.from_hf(base), fsdp=1, tp=1, devices=jax.devices()[:1])
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}

    def run(out):
        args = {**CONFIG, "max_steps": 4, "save_strategy": "steps", "save_steps": 1, "output_dir": str(out)}
        del args["use_cpu"]
        return SFTRun.create(args, base, stream(11), lora=lora, tokenizer=tokenizer(), mesh=mesh, progress=False)

    def history(out):
        return [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "loss" in e]

    with pytest.raises(RecipeError, match="max_steps"):
        SFTRun.create({**CONFIG, "max_steps": -1}, base, stream(11), lora=lora, tokenizer=tokenizer(), mesh=mesh)
    whole = run(tmp_path / "whole")
    assert whole.max_steps == 4 and whole.plan.num_samples is None
    whole.train()
    logged = HFOutputs.on_train_step_end

    def stop_after_2(self, trainer, train_step, train_loss):
        logged(self, trainer, train_step, train_loss)
        if train_step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(HFOutputs, "on_train_step_end", stop_after_2)
    from gemport.errors import Preempted

    with pytest.raises(Preempted):
        run(tmp_path / "stopped").train()
    monkeypatch.setattr(HFOutputs, "on_train_step_end", logged)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # 11 chats: two whole steps a pass, nothing skipped
        run(tmp_path / "stopped").train()
    assert history(tmp_path / "stopped") == history(tmp_path / "whole")

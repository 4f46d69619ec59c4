"""Faults a training run meets, as a TPU user meets them: each a typed error naming the culprit, or a recovery
that says what it did; inputs untouched, and nothing left that looks complete and is not.

Most faults are tested where gemport handles them (the resume-point finder on a real Tunix checkpoint, the record
reader, the token-id check, the output lock); two `gemport sft` runs on one tiny Gemma 4 cover the end to end:
a damaged latest checkpoint resumed from the one before it to the uninterrupted run's adapter, and a non-finite
loss refused at its step.
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from gemport.data import from_sft_config

from gemport.run import SFTRun
from gemport.checkpoint.integrity import damage, resume_step, steps
from gemport.errors import CheckpointError, CheckpointWarning, LoraError, MaskError
from gemport.data.splits import load_splits
from gemport.run.lock import LOCK, claim_output
from gemport.data.vocabulary import check_token_ids
from fault_child import write_checkpoints
from tiny_tokenizers import GEMMA3_CONTROL, char_tokenizer
from chats import chats, tokenizer
from repo_paths import HELPERS

CHILD = HELPERS / "fault_child.py"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A checkpoint root with steps 1, 2, 3; each test damages a copy."""
    root = tmp_path_factory.mktemp("written") / "checkpoints"
    write_checkpoints(root)
    assert steps(root) == [1, 2, 3]
    return root


def zero(*files):
    for f in files:
        if f.is_file():
            f.write_bytes(b"\0" * f.stat().st_size)


def orbax_latest(root):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(root, item_handlers={"model_params": ocp.PyTreeCheckpointHandler(),
                                                    "optimizer_state": ocp.PyTreeCheckpointHandler()}) as m:
        return m.latest_step()


DAMAGE = {  # fault -> how it leaves step 3
    "latest zeroed (a full disk, an interrupted copy)": lambda s: zero(*s.rglob("*")),
    "Orbax checkpoint metadata zeroed": lambda s: zero(s / "_CHECKPOINT_METADATA"),
    "LoRA params' array metadata zeroed": lambda s: zero(s / "model_params" / "_METADATA"),
    "LoRA params' data zeroed": lambda s: zero(*(s / "model_params" / "d").rglob("*")),
    "optimizer state missing (a partial copy)": lambda s: shutil.rmtree(s / "optimizer_state"),
    "an empty step directory (a copy that never started)": lambda s: [shutil.rmtree(s), s.mkdir()],
}


@pytest.mark.parametrize("fault", DAMAGE)
def test_damaged_latest_checkpoint_is_set_aside_and_the_one_before_resumed(checkpoints, tmp_path, fault):
    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoints, root)
    assert damage(root / "3") is None
    DAMAGE[fault](root / "3")
    assert damage(root / "3") is not None
    with pytest.warns(CheckpointWarning, match=r"damaged checkpoint skipped: step 3 \(.*set aside as .*damaged-3\); "
                                               r"resuming from step 2"):
        assert resume_step(root) == 2
    assert steps(root) == [1, 2] and (root / "damaged-3").is_dir()  # kept for inspection, out of Orbax's sight
    assert orbax_latest(root) == 2


def test_damaged_older_checkpoints_fall_back_further_and_to_step_0(checkpoints, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoints, root)
    zero(root / "3" / "_CHECKPOINT_METADATA", root / "2" / "model_params" / "_METADATA")
    with pytest.warns(CheckpointWarning, match="step 3 .* step 2 .*resuming from step 1"):
        assert resume_step(root) == 1
    zero(root / "1" / "_CHECKPOINT_METADATA")
    (root / "3").mkdir()  # the same step damaged again after a rerun: set aside beside the first
    with pytest.warns(CheckpointWarning, match="damaged-3.2.*no intact checkpoint left: training from step 0"):
        assert resume_step(root) is None
    assert steps(root) == [] and orbax_latest(root) is None


def test_intact_checkpoints_and_a_killed_save_resume_from_the_newest_without_a_word(checkpoints, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoints, root)
    shutil.copytree(root / "3", root / "4.orbax-checkpoint-tmp")  # a save killed before Orbax's rename
    zero(*(root / "4.orbax-checkpoint-tmp").rglob("*"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resume_step(root) == 3
    assert steps(root) == [1, 2, 3] and orbax_latest(root) == 3


def test_damaged_lora_spec_beside_the_checkpoints_is_named(checkpoints, tmp_path):
    from gemport.checkpoint import load_lora

    root = tmp_path / "checkpoints"
    shutil.copytree(checkpoints, root)
    (root / "gemport_lora.json").write_bytes(b"\0" * 40)
    with pytest.raises(LoraError, match="gemport_lora.json: not a LoraSpec"):
        load_lora(root)


def test_disk_full_while_saving_is_named_and_keeps_the_checkpoints_written(tmp_path):
    root = tmp_path / "checkpoints"
    failed = subprocess.run([sys.executable, str(CHILD), str(root), "3", "2", "1"],  # save_total_limit 1
                            capture_output=True, text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=""))
    assert failed.returncode == 1
    (last,) = [line for line in failed.stderr.splitlines() if line.startswith("gemport.errors.CheckpointError: ")]
    assert "writing a checkpoint failed (step 2)" in last, last
    assert "File too large" in last and "Checkpoints kept: [1]" in last and "run the same command again" in last
    assert steps(root) == [1] and damage(root / "1") is None  # nothing that looks complete and is not
    assert resume_step(root) == 1


# Data errors: every TRL format, named by file and line (or index) and field.
U = {"role": "user", "content": "hi"}
RECORDS = {
    "assistant content a number": ({"messages": [U, {"role": "assistant", "content": 3}]}, "messages[1].content"),
    "message without role": ({"messages": [U, {"content": "x"}]}, "messages[1]: expected a dict with a string 'role'"),
    "messages not a list": ({"messages": "hello"}, "record['messages']: expected a list"),
    "empty conversation": ({"messages": []}, "record['messages']: an empty conversation"),
    "ShareGPT roles kept, as TRL keeps them": ({"conversations": [{"from": "human", "value": "x"}]}, "role 'human'"),
    "completion null": ({"prompt": "a", "completion": None}, "record['completion']: expected a string"),
    "prompt without completion": ({"prompt": "a"}, "keys ['prompt'] match no SFT format"),
    "conversational prompt, string completion": ({"prompt": [U], "completion": "b"}, "record['prompt']"),
    "text a number": ({"text": 5}, "record['text']: expected a string, got int"),
    "record a list": ([1, 2], "record: expected a dict"),
    "tools not JSON": ({"messages": [U, {"role": "assistant", "content": "x"}], "tools": "{bad"}, "record['tools']"),
    "image part": ({"messages": [U, {"role": "assistant", "content": [{"type": "image"}]}]}, "content[0]"),
    "unknown chat_template_kwargs": ({"messages": [U], "chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs"),
}


def examples_of(source):
    t = tokenizer()
    t.eos_token = "<turn|>"  # the standard formats append it
    return from_sft_config({"max_length": 128, "assistant_only_loss": True}, t).examples(source, t,
                                                                                                 progress=False)


@pytest.mark.parametrize("fault", RECORDS)
def test_malformed_record_in_a_jsonl_file_is_named_by_line_and_field(tmp_path, fault):
    record, field = RECORDS[fault]
    path = tmp_path / "train.jsonl"
    lines = [json.dumps(r) for r in chats(20)]
    lines[17:17] = ["", json.dumps(record)]  # after a blank line: line 19 of the file, record 17
    path.write_text("\n".join(lines) + "\n")
    before = path.read_bytes()
    with pytest.raises(MaskError) as error:
        examples_of(path)
    assert str(error.value).startswith(f"{path}:19: ") and field in str(error.value), str(error.value)
    assert path.read_bytes() == before


def test_malformed_record_is_named_in_json_parquet_lists_and_folders(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = chats(6)
    records[4] = {"prompt": "a", "completion": 7}
    (tmp_path / "train.json").write_text(json.dumps(records))
    with pytest.raises(MaskError, match=rf"^{tmp_path / 'train.json'}\[4\]: record\['completion'\]"):
        examples_of(tmp_path / "train.json")
    rows = [{"text": f"row {i}"} for i in range(5)] + [{"text": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    with pytest.raises(MaskError, match=rf"^{tmp_path / 'train.parquet'}\[5\]: record\['text'\]"):
        examples_of(tmp_path / "train.parquet")
    with pytest.raises(MaskError, match=r"^record 4: record\['completion'\]"):
        examples_of(records)
    (tmp_path / "data").mkdir()  # dataset_name a folder: datasets fails to parse a line, gemport names it
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps(chats(1)[0]) + "\n" + '{"messages": [\n')
    with pytest.raises(MaskError, match=rf"^{tmp_path / 'data' / 'train.jsonl'}:2: not valid JSON"):
        load_splits(tmp_path / "data")
    # A malformed record among those the template check samples is named too, not failed inside the template.
    records[1] = {"messages": [U, {"role": "assistant", "content": 3}]}
    with pytest.raises(MaskError, match=r"^record 1: messages\[1\]\.content"):
        examples_of(records)


# Tokenizer / model mismatches.
def test_token_ids_past_the_embedding_are_refused_before_the_model_loads(hf_checkpoint):
    _, base = hf_checkpoint("gemma4_mesh")
    vocab = 128
    t = tokenizer()
    added = [f"<extra_{i}>" for i in range(vocab + 2 - len(t))]
    t.add_tokens(added)  # a team adds tokens to the tokenizer and does not resize the model
    records = chats(6)
    records[3]["messages"][-1]["content"] += " " + added[-1]
    args = dict(max_length=128, per_device_train_batch_size=2, max_steps=1, assistant_only_loss=True)
    with pytest.raises(MaskError) as error:
        SFTRun.create(args, base, records, lora={"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}, tokenizer=t)
    message = str(error.value)
    for words in ("train example 3: token id 129 ('<extra_", "vocab_size 128", f"tokenizer has {len(t)} tokens",
                  "resize_token_embeddings"):
        assert words in message, message
    assert "Traceback" not in message


def test_token_id_check_is_one_pass_over_every_id_and_the_pad_id():
    from gemport.data.tokenize import Example

    t = char_tokenizer(GEMMA3_CONTROL)

    def example(ids):
        ids = np.asarray(ids, np.int32)
        return Example(ids, np.ones(len(ids), bool), np.zeros(len(ids), np.int32), np.zeros(len(ids), np.int8),
                       np.zeros(len(ids), np.int8))

    good = [example(range(i, i + 9)) for i in range(0, 90, 9)]
    check_token_ids(good, 100, t, pad_id=0)
    with pytest.raises(MaskError, match=r"eval example 4: token id 100 .*\(2 distinct ids .*\[100, 103\]"):
        check_token_ids(good[:4] + [example([5, 100, 103, 100])] + good, 100, t, split="eval")
    with pytest.raises(MaskError, match=r"train example 1: token id -1"):
        check_token_ids([good[0], example([3, -1])], 100, t)
    with pytest.raises(MaskError, match=r"the pad id 100 .* not below the model's vocab_size 100"):
        check_token_ids(good, 100, t, pad_id=100)


def test_tokenizer_without_the_chat_formats_control_tokens_is_refused():
    t = char_tokenizer(["<bos>", "<pad>"])  # a tokenizer of another family: Gemma's turn markers split into pieces
    t.chat_template = tokenizer().chat_template
    with pytest.raises(MaskError, match="encodes to .* tokens .*add the Gemma control tokens"):
        from_sft_config({"max_length": 128}, tokenizer()).examples(chats(2), t, progress=False)


# The output directory.
HOLD = ("import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
        "f.write(f'pid {os.getpid()} on this host\\n'); f.flush(); print('held', flush=True); time.sleep(120)")


def test_two_runs_on_one_output_dir_the_second_is_refused_naming_the_first(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=rf"output_dir {out} is in use by another run \(pid {holder.pid} "):
            claim_output(out)
    finally:
        holder.kill()
        holder.wait()
    assert claim_output(out) == out.resolve()  # a killed run's lock is released by the kernel
    assert claim_output(out) == out.resolve()  # and this process may claim it again
    assert f"pid {os.getpid()} on " in (out / LOCK).read_text()


def test_unwritable_output_dir_is_refused_before_anything_runs(tmp_path):
    if os.geteuid() == 0:  # root writes through permissions: a kernel filesystem refuses it
        out = Path("/sys/kernel")
    else:
        out = tmp_path / "readonly"
        out.mkdir()
        out.chmod(0o555)
    with pytest.raises(CheckpointError, match=rf"output_dir {out}: cannot write there"):
        claim_output(out)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(CheckpointError, match="cannot write there"):
        claim_output(tmp_path / "a-file" / "out")


# End to end: `gemport sft` on one tiny Gemma 4.
@pytest.fixture(scope="module")
def sft_dir(hf_checkpoint, tmp_path_factory):
    """A base checkpoint with the chat tokenizer, a train.jsonl, and a recipe writing `out` (3 steps, a
    checkpoint each)."""
    import transformers

    _, base = hf_checkpoint("gemma4_mesh")
    root = tmp_path_factory.mktemp("sft-faults")
    transformers.AutoModelForCausalLM.from_pretrained(base).save_pretrained(root / "base")
    tokenizer().save_pretrained(root / "base")
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(12)))
    (root / "sft.yaml").write_text(json.dumps({
        "model_name_or_path": str(root / "base"), "dataset_name": str(root / "train.jsonl"),
        "use_peft": True, "lora_r": 2, "lora_alpha": 4, "lora_dropout": 0.0,
        "lora_target_modules": ["q_proj", "o_proj"],
        "assistant_only_loss": True, "max_length": 64, "per_device_train_batch_size": 2, "max_steps": 3,
        "learning_rate": 1e-2, "logging_steps": 1, "save_steps": 1, "save_total_limit": 2, "bf16": False,
        "report_to": "none", "disable_tqdm": True, "output_dir": str(root / "out")}))
    return root


def adapter(out):
    from safetensors.numpy import load_file

    return load_file(out / "adapter_model.safetensors")


def test_sft_resumes_from_the_last_intact_checkpoint_to_the_same_adapter(sft_dir):
    from gemport_cli import gemport

    out = sft_dir / "out"
    data = (sft_dir / "train.jsonl").read_bytes()
    gemport("sft", "--config", sft_dir / "sft.yaml")
    assert steps(out / "checkpoints") == [2, 3]  # save_total_limit 2
    uninterrupted = adapter(out)
    losses = [e["loss"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"]]
    zero(*(out / "checkpoints" / "3").rglob("*"))  # the latest checkpoint's files zeroed, as the issue found them
    with pytest.warns(CheckpointWarning, match=r"step 3 \(_CHECKPOINT_METADATA is not readable JSON.*"
                                               r"resuming from step 2"):
        done = gemport("sft", "--config", sft_dir / "sft.yaml")
    assert "trained to step 3" in done.stdout and "Traceback" not in done.stderr
    assert steps(out / "checkpoints") == [2, 3] and damage(out / "checkpoints" / "3") is None
    assert (out / "checkpoints" / "damaged-3").is_dir()
    resumed = adapter(out)
    assert sorted(resumed) == sorted(uninterrupted) and len(resumed) > 0
    for name in resumed:  # step 3 trained again from checkpoint 2: the same adapter, bit for bit
        np.testing.assert_array_equal(resumed[name], uninterrupted[name], err_msg=name)
    assert [e["loss"] for e in json.loads((out / "trainer_state.json").read_text())["log_history"]] == losses
    assert (sft_dir / "train.jsonl").read_bytes() == data  # inputs untouched


def test_sft_refuses_a_non_finite_loss_at_its_step_and_keeps_the_checkpoint_before(sft_dir, tmp_path):
    from gemport_cli import gemport, one_line_error

    out = tmp_path / "nan"
    # A learning rate off by many orders of magnitude: step 1's update overflows the weights, step 2's loss is not
    # finite. HF's Trainer logs it and trains on; gemport stops before checkpointing those weights.
    done = gemport("sft", "--config", sft_dir / "sft.yaml", "--learning_rate", "1e38", "--output_dir", out, ok=False)
    one_line_error(done, "step 2: the loss is", "the last checkpoint, step 1 in", "lower learning_rate")
    assert steps(out / "checkpoints") == [1] and damage(out / "checkpoints" / "1") is None
    assert not (out / "adapter_model.safetensors").exists()  # no adapter that looks trained

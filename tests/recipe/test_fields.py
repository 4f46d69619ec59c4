"""The recipe table (``gemport.recipe``: USED, MAPPED, refused) and the behaviour, field by field, generated from it.

Every field the table marks used has an entry in ``BEHAVIOUR``: a check that changing the field changes what the
run does, as TRL/HF would (the masks, the batches and their order, the optimizer's updates, the evaluation,
logging and checkpoint cadence), at the level of the objects the recipe builds, without a model. A field added
to ``USED`` without an entry fails ``test_a_used_field_changes_the_run``. Every mapped field set away from its
default prints its note; every other field of TRL's three classes is refused when the recipe is read, naming it.
"""

import dataclasses
import functools
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from gemport.recipe import RunFields
from gemport.step.precision import matmul_precision
from gemport.errors import GemportError, LoraError, MaskError, OptimizerConfigError, RecipeError
from gemport.lora import LoraSpec
from gemport.optim.hf import hf_optimizer
from gemport import recipe
from gemport.run.sft import checkpoint_root, eval_batches, training_config
from gemport.data.sft import from_sft_config
from gemport_cli import gemport, one_line_error
from chats import chats
from tiny import text_config
from repo_paths import HELPERS
from recipe_objects import DATA, TOK, examples, lora, outputs, sft, steps


def updates(**fields):
    """The parameters after 3 optimizer steps of HF's AdamW and schedule on fixed gradients, the first below
    the clipping norm and the others above it (gradients of one norm would make Adam's v, and so adam_beta2,
    cancel out exactly)."""
    import jax.numpy as jnp
    import optax

    opt = hf_optimizer(sft(**{"learning_rate": 1e-2, **fields}), num_training_steps=6)
    params = {"w": jnp.ones(4)}
    state = opt.tx.init(params)
    for g in (0.1, -3.0, 2.0):
        u, state = opt.tx.update({"w": jnp.full(4, g) * jnp.arange(1, 5)}, state, params)
        params = optax.apply_updates(params, u)
    return np.asarray(params["w"])


def differ(a, b):
    return not np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object))


def refused(error, field, build):
    with pytest.raises(error, match=field):
        build()
    return True


def cli_recipe(tmp_path, **fields):
    (tmp_path / "data").mkdir(exist_ok=True)
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps(DATA[0]) + "\n")
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({"model_name_or_path": str(tmp_path / "base"), "use_peft": True,
                                      "dataset_name": str(tmp_path / "data"), "output_dir": str(tmp_path / "out"),
                                      **fields}))
    return config


# ---- the checks, one per used field -----------------------------------------------------------------------------

def _dataset_splits(tmp_path):
    from gemport.data.splits import load_splits

    (tmp_path / "d").mkdir()
    for split, n in (("train", 3), ("test", 2), ("validation", 1)):
        (tmp_path / "d" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats(n)))
    return load_splits, tmp_path / "d"


def check_dataset_name(tmp_path):
    load_splits, folder = _dataset_splits(tmp_path)
    assert len(load_splits(folder)[0]) == 3 and load_splits(folder / "test.jsonl")[0] == folder / "test.jsonl"


def check_dataset_config(tmp_path):
    load_splits, folder = _dataset_splits(tmp_path)
    assert len(load_splits(folder, "default")[0]) == 3
    refused(MaskError, "dataset_config='other'", lambda: load_splits(folder, "other"))


def check_dataset_train_split(tmp_path):
    load_splits, folder = _dataset_splits(tmp_path)
    assert len(load_splits(folder, train_split="validation")[0]) == 1


def check_dataset_test_split(tmp_path):
    load_splits, folder = _dataset_splits(tmp_path)
    assert len(load_splits(folder, with_test=True)[1]) == 2
    assert len(load_splits(folder, test_split="validation", with_test=True)[1]) == 1


def check_dataset_streaming(tmp_path):
    import datasets

    from gemport.data.stream import Stream, streamed

    load_splits, folder = _dataset_splits(tmp_path)
    train, _ = load_splits(folder, streaming=True)
    assert isinstance(train, datasets.IterableDataset) and streamed(train) and not streamed(load_splits(folder)[0])
    assert load_splits(folder / "test.jsonl", streaming=True)[0] == Stream(folder / "test.jsonl")


def check_model_name_or_path(tmp_path):
    one_line_error(gemport("sft", "--config", cli_recipe(tmp_path, lora_target_modules=["q_proj"]), ok=False),
                   str(tmp_path / "base"))


def check_dtype(tmp_path):
    assert recipe.read({"dtype": "float32"}).dtype() == np.float32
    assert recipe.read({"dtype": "bfloat16", "bf16": False}).dtype().name == "bfloat16"


def check_bf16(tmp_path):
    assert recipe.read({}).dtype().name == "bfloat16" and recipe.read({"bf16": False}).dtype() == np.float32


def check_use_peft(tmp_path):
    assert recipe.read({}).lora() is None and recipe.read({"use_peft": True}).lora()["peft_type"] == "LORA"


def check_lora_r(tmp_path):
    assert lora().rank == 16 and lora(lora_r=4).rank == 4  # ModelConfig's default r


def check_lora_alpha(tmp_path):
    assert lora().alpha == 32 and lora(lora_alpha=8).alpha == 8


def check_lora_dropout(tmp_path):
    assert lora().dropout == 0.05 and lora(lora_dropout=0.0).dropout == 0.0  # TRL's default, not PEFT's


def check_lora_target_modules(tmp_path):
    assert lora().targets == ("q_proj",) and set(lora(lora_target_modules=["v_proj", "k_proj"]).targets) == \
        {"v_proj", "k_proj"}
    # Unset: PEFT's default for the base's model_type, which trains (k_proj a zero slot of the fused kv_einsum;
    # the run: test_sft_fields; equal to PEFT: lora/test_peft_training's +qv cases).
    from gemport.lora import LoraLayout
    from gemport.specs import GemmaSpec
    from gemport.run.sft import with_peft_targets

    unset = recipe.read({"use_peft": True}).lora()
    assert unset["target_modules"] is None
    text_config("gemma3_1b").save_pretrained(tmp_path / "base")
    resolved = LoraSpec.from_peft(with_peft_targets(unset, tmp_path / "base"))
    assert resolved.targets == ("q_proj", "v_proj")
    kv = [a for a in LoraLayout(GemmaSpec.from_hf(tmp_path / "base"), resolved) if a.module.endswith("kv_einsum")]
    assert kv and all(a.ranks == (0, unset["r"]) for a in kv)


def check_lora_target_parameters(tmp_path):
    # PEFT's LoRA on the MoE experts (equal to PEFT: lora/test_peft_training's gemma4_moe case), which PEFT
    # refuses with dropout: TRL's default lora_dropout 0.05 is refused with it.
    experts = ["experts.gate_up_proj", "experts.down_proj"]
    assert lora(lora_dropout=0.0).parameters == ()
    assert lora(lora_target_parameters=experts, lora_dropout=0.0).parameters == tuple(experts)
    refused(LoraError, "lora_dropout", lambda: lora(lora_target_parameters=experts))
    # Without lora_target_modules, on a model_type PEFT has no default for (gemma4_text), PEFT adapts the
    # parameters alone.
    from gemport.run.sft import with_peft_targets

    text_config("gemma4_moe").save_pretrained(tmp_path / "moe")
    unset = recipe.read({"use_peft": True, "lora_target_parameters": experts, "lora_dropout": 0.0}).lora()
    resolved = LoraSpec.from_peft(with_peft_targets(unset, tmp_path / "moe"))
    assert resolved.targets == () and resolved.parameters == tuple(experts)


def check_use_rslora(tmp_path):
    assert not lora().rslora and lora(use_rslora=True).rslora


def check_lora_task_type(tmp_path):
    refused(RecipeError, "lora_task_type", lambda: recipe.read({"lora_task_type": "SEQ_CLS"}))


def check_load_in_4bit(tmp_path):
    assert recipe.read({}).qlora() is None and recipe.read({"load_in_4bit": True}).qlora().qtype == "nf4"


def check_bnb_4bit_quant_type(tmp_path):
    refused(LoraError, "bnb_4bit_quant_type", lambda: recipe.read({"load_in_4bit": True,
                                                                  "bnb_4bit_quant_type": "fp4"}).qlora())


def check_use_bnb_nested_quant(tmp_path):
    assert recipe.read({"load_in_4bit": True, "use_bnb_nested_quant": True}).qlora().double_quant


def check_assistant_only_loss(tmp_path):
    every, _ = examples(assistant_only_loss=False)
    assistant, _ = examples()
    assert sum(e.loss_mask.sum() for e in assistant) < sum(e.loss_mask.sum() for e in every)


def check_completion_only_loss(tmp_path):
    records = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in DATA]
    default, _ = examples(records, assistant_only_loss=False)  # TRL: None trains the completion only
    everything, _ = examples(records, assistant_only_loss=False, completion_only_loss=False)
    assert sum(e.loss_mask.sum() for e in default) < sum(e.loss_mask.sum() for e in everything)


def check_max_length(tmp_path):
    kept, report = examples(max_length=40)
    assert max(len(e.tokens) for e in kept) <= 40 < max(len(e.tokens) for e in examples()[0])
    assert report.dropped_too_long + report.trimmed > 0


def check_truncation_mode(tmp_path):
    refused(RecipeError, "truncation_mode", lambda: examples(truncation_mode="keep_end"))


def check_packing(tmp_path):
    _, batches = steps(packing=True)
    assert batches[0]["tokens"].shape[-1] == 128 and (batches[0]["segment_ids"] > 1).any()


def check_dataset_num_proc(tmp_path):
    # TRL packs each of dataset_num_proc shards on its own: other rows.
    def rows(**fields):
        units = from_sft_config(sft(packing=True, **fields), TOK).units(examples(packing=True)[0])
        return [r[s > 0].tolist() for r, s in zip(units["tokens"], units["segment_ids"])]

    assert rows(dataset_num_proc=3) != rows() == rows(dataset_num_proc=1)


def check_packing_strategy(tmp_path):
    refused(RecipeError, "packing_strategy", lambda: steps(packing=True, packing_strategy="wrapped"))


def check_padding_free(tmp_path):
    assert steps(padding_free=True)[1][0]["tokens"].shape[1] == 1 != steps()[1][0]["tokens"].shape[1]


def check_pad_to_multiple_of(tmp_path):
    assert steps(pad_to_multiple_of=64)[1][0]["tokens"].shape[-1] % 64 == 0 != steps()[1][0]["tokens"].shape[-1] % 64


def check_dataset_text_field(tmp_path):
    records = [{"content": "hello there"}]
    refused(MaskError, "text", lambda: examples(records, eos_token="<pad>"))
    assert len(examples(records, dataset_text_field="content", eos_token="<pad>")[0][0].tokens) >= len("hello")


def check_eos_token(tmp_path):
    records = [{"text": "hello"}]
    plain, _ = examples(records, assistant_only_loss=False, eos_token="<pad>")
    ended, _ = examples(records, assistant_only_loss=False, eos_token="<turn|>")
    assert ended[0].tokens[-1] == TOK.convert_tokens_to_ids("<turn|>") != plain[0].tokens[-1]
    refused(RecipeError, "eos_token", lambda: examples(records, eos_token="<nope>"))


def check_pad_token(tmp_path):
    pipeline = from_sft_config(sft(pad_token="<turn|>"), TOK)
    assert pipeline.pad_id == TOK.convert_tokens_to_ids("<turn|>") != from_sft_config(sft(), TOK).pad_id


def check_loss_type(tmp_path):
    refused(RecipeError, "loss_type", lambda: examples(loss_type="dft"))


def check_shuffle_dataset(tmp_path):
    refused(RecipeError, "shuffle_dataset", lambda: examples(shuffle_dataset=True))


def check_chat_template_path(tmp_path):
    from gemport.data.chat_template import check_records, with_chat_template

    (tmp_path / "t.jinja").write_text("Hello " + TOK.chat_template)
    other = with_chat_template(TOK, tmp_path / "t.jinja", 128)
    assert other.chat_template.startswith("Hello ") and not TOK.chat_template.startswith("Hello ")
    refused(RecipeError, "chat_template_path", lambda: check_records(DATA, other, from_sft_config(sft(), TOK).chat_format))


def check_per_device_train_batch_size(tmp_path):
    assert steps(per_device_train_batch_size=3)[1][0]["tokens"].shape[1] == 3


def check_gradient_accumulation_steps(tmp_path):
    assert steps(gradient_accumulation_steps=2)[1][0]["tokens"].shape[0] == 2 == 2 * steps()[1][0]["tokens"].shape[0]


def check_seed(tmp_path):
    assert differ(steps()[0], steps(seed=4)[0])


def check_data_seed(tmp_path):
    assert differ(steps()[0], steps(data_seed=4)[0])


def check_train_sampling_strategy(tmp_path):
    order, _ = steps(train_sampling_strategy="sequential")
    assert order[0] == ((0, 1),) and differ(order, steps()[0])


def check_max_steps(tmp_path):
    assert len(steps(max_steps=7)[0]) == 7


def check_num_train_epochs(tmp_path):
    assert len(steps(max_steps=-1, num_train_epochs=2)[0]) == 12 == 2 * len(steps(max_steps=-1, num_train_epochs=1)[0])


def check_dataloader_drop_last(tmp_path):
    assert len(steps(max_steps=-1, num_train_epochs=1, per_device_train_batch_size=5)[0]) == 3  # 12 examples
    assert len(steps(max_steps=-1, num_train_epochs=1, per_device_train_batch_size=5, dataloader_drop_last=True)[0]) == 2
    evals = examples(chats(5))[0]
    assert len(eval_batches(evals, 2)) == 3 and len(eval_batches(evals, 2, drop_last=True)) == 2


def _changes_updates(**fields):
    assert differ(updates(**fields).round(7), updates().round(7))


check_learning_rate = lambda tmp_path: _changes_updates(learning_rate=1e-3)  # noqa: E731
check_weight_decay = lambda tmp_path: _changes_updates(weight_decay=0.5)  # noqa: E731
check_adam_beta1 = lambda tmp_path: _changes_updates(adam_beta1=0.5)  # noqa: E731
check_adam_beta2 = lambda tmp_path: _changes_updates(adam_beta2=0.5)  # noqa: E731
check_adam_epsilon = lambda tmp_path: _changes_updates(adam_epsilon=1.0)  # noqa: E731
check_max_grad_norm = lambda tmp_path: _changes_updates(max_grad_norm=1e-3)  # noqa: E731
check_lr_scheduler_type = lambda tmp_path: _changes_updates(lr_scheduler_type="constant")  # noqa: E731
check_warmup_steps = lambda tmp_path: _changes_updates(warmup_steps=2)  # noqa: E731
check_warmup_ratio = lambda tmp_path: _changes_updates(warmup_ratio=0.5)  # noqa: E731


def check_lr_scheduler_kwargs(tmp_path):
    def restarts(cycles):
        return updates(lr_scheduler_type="cosine_with_restarts", lr_scheduler_kwargs={"num_cycles": cycles})

    assert differ(restarts(1).round(7), restarts(2).round(7))


def check_optim(tmp_path):
    np.testing.assert_array_equal(updates(optim="adamw_torch"), updates())  # the same AdamW, fused or not
    refused(OptimizerConfigError, "optim", lambda: updates(optim="sgd"))


def check_average_tokens_across_devices(tmp_path):
    refused(OptimizerConfigError, "average_tokens_across_devices", lambda: updates(average_tokens_across_devices=False))


def check_output_dir(tmp_path):
    assert checkpoint_root(sft(output_dir=str(tmp_path))) == tmp_path / "checkpoints"
    assert checkpoint_root(sft()) is None


def check_save_strategy(tmp_path):
    assert checkpoint_root(sft(output_dir=str(tmp_path), save_strategy="no")) is None
    refused(RecipeError, "save_strategy", lambda: recipe.read({"save_strategy": "epoch"}))


def check_save_steps(tmp_path):
    config = training_config(sft(save_steps=3), 10, checkpoint_dir=tmp_path)
    assert config.checkpointing_options.save_interval_steps == 3


def check_save_total_limit(tmp_path):
    assert training_config(sft(save_total_limit=2), 10, checkpoint_dir=tmp_path).checkpointing_options.max_to_keep == 2


def check_resume_from_checkpoint(tmp_path):
    one_line_error(gemport("sft", "--config", cli_recipe(tmp_path, lora_target_modules=["q_proj"]),
                           "--resume_from_checkpoint", "true", ok=False), "no checkpoint in")
    from gemport.run.record import check_resume

    (tmp_path / "root" / "1").mkdir(parents=True)
    refused(RecipeError, "without gemport_recipe.json", lambda: check_resume(tmp_path / "root", {}, explicit=False))
    check_resume(tmp_path / "root", {}, explicit=True)


def check_eval_strategy(tmp_path):
    assert training_config(sft(eval_strategy="steps", eval_steps=2), 10, evaluate=True).eval_every_n_steps == 2
    assert training_config(sft(eval_strategy="no", eval_steps=2), 10, evaluate=True).eval_every_n_steps == 11
    refused(RecipeError, "eval_strategy", lambda: recipe.read({"eval_strategy": "epoch"}))


def check_eval_steps(tmp_path):
    assert training_config(sft(eval_strategy="steps", eval_steps=0.5), 10, evaluate=True).eval_every_n_steps == 5


def check_per_device_eval_batch_size(tmp_path):
    assert eval_batches(examples(chats(5))[0], 3)[0]["tokens"].shape[1] == 3


def check_eval_on_start(tmp_path):
    assert outputs(tmp_path, eval_on_start=True).eval_on_start and not outputs(tmp_path).eval_on_start


def check_logging_strategy(tmp_path):
    refused(RecipeError, "logging_strategy", lambda: recipe.read({"logging_strategy": "epoch"}))


def check_logging_steps(tmp_path):
    assert outputs(tmp_path, logging_steps=3).logging_steps == 3 and outputs(tmp_path).logging_steps == 10


def check_logging_first_step(tmp_path):
    assert outputs(tmp_path, logging_first_step=True).first and not outputs(tmp_path).first


def check_logging_dir(tmp_path):
    hooks = outputs(tmp_path, report_to="tensorboard", logging_dir=str(tmp_path / "tb"))
    hooks.finish()
    assert any((tmp_path / "tb").iterdir()) and not (tmp_path / "runs").exists()


def check_report_to(tmp_path):
    assert [type(t).__name__ for t in outputs(tmp_path, report_to="tensorboard").trackers] == ["TensorBoard"]
    assert outputs(tmp_path / "none", report_to="none").trackers == []
    refused(RecipeError, "report_to", lambda: outputs(tmp_path, report_to="mlflow"))


def _trackio_runs(tmp_path, **fields):
    """The (project, run name) pairs trackio's local store holds after a run of ``fields`` reports to it (a
    process of its own: trackio reads TRACKIO_DIR when it is imported)."""
    import subprocess
    import sys

    script = f"""
import json, sys, types
sys.path[:0] = {[str(HELPERS)]!r}
from recipe_objects import outputs
from pathlib import Path
hooks = outputs(Path({str(tmp_path)!r}), report_to="trackio", **{fields!r})
for tracker in hooks.trackers:
    tracker.log({{"train/loss": 1.0}}, 1)
hooks.finish()
from trackio.sqlite_storage import SQLiteStorage as S
print(json.dumps([(p, r) for p in S.get_projects() for r in S.get_runs(p)]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True,
                          env=dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio")))
    return [tuple(pair) for pair in json.loads(done.stdout.splitlines()[-1])]


@functools.cache
def _one_trackio_run():
    """One run reporting to trackio with run_name and project set (a process costs seconds; both checks read it)."""
    return _trackio_runs(Path(tempfile.mkdtemp()), run_name="first-port", project="fields-project")


def check_run_name(tmp_path):
    assert [r for _, r in _one_trackio_run()] == ["first-port"]


def check_project(tmp_path):
    assert [p for p, _ in _one_trackio_run()] == ["fields-project"]


def check_disable_tqdm(tmp_path):
    assert outputs(tmp_path, disable_tqdm=True).bar.disable and not outputs(tmp_path).bar.disable


def check_gradient_checkpointing(tmp_path):
    assert from_sft_config(sft(), TOK).remat == "decoder" and from_sft_config(sft(gradient_checkpointing=False),
                                                                             TOK).remat == "none"


def check_gradient_checkpointing_kwargs(tmp_path):
    assert from_sft_config(sft(gradient_checkpointing_kwargs={"use_reentrant": False}), TOK).remat == "decoder"
    refused(RecipeError, "gradient_checkpointing_kwargs", lambda: from_sft_config(
        sft(gradient_checkpointing_kwargs={"preserve_rng_state": False}), TOK))


def check_tf32(tmp_path):
    """A float32 recipe's products: float32 ("highest"), or TF32's faster ones with tf32 (the trainer traces its
    step under it: tests/step/test_precision.py)."""
    def precision(**fields):
        f = RunFields.from_config(sft(bf16=False, **fields))
        return matmul_precision(f.bf16, f.tf32)

    assert precision() == "highest" and precision(tf32=True) == "high"


BEHAVIOUR = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}


# ---- the generated tests -----------------------------------------------------------------------------------------

def _other_value(default):
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 1
    if isinstance(default, (list, tuple)):
        return ["other"]
    if isinstance(default, dict):
        return {"other": 1}
    return f"{getattr(default, 'value', default)}_other"


def _trl_fields():
    out = {}
    for owner in ("ScriptArguments", "ModelConfig", "SFTConfig"):
        out.update(recipe.defaults(owner))
    return out


@pytest.mark.parametrize("field", sorted(recipe.USED))
def test_a_used_field_changes_the_run(field, tmp_path):
    assert field in BEHAVIOUR, f"{field} is marked used in gemport/recipe/fields.py but has no behaviour check here"
    BEHAVIOUR[field](tmp_path)


@pytest.mark.parametrize("field", sorted(recipe.MAPPED))
def test_a_mapped_field_prints_its_note(field):
    value = _other_value(_trl_fields()[field])
    notes = recipe.read({field: value}).notes
    assert notes == (f"{field}={value!r}: {recipe.MAPPED[field]}",)
    assert recipe.read({field: _trl_fields()[field]}).notes == ()  # at TRL's default: nothing to say


REFUSED = sorted(set(_trl_fields()) - recipe.USED - set(recipe.MAPPED) - {"env"})


@pytest.mark.parametrize("field", REFUSED)
def test_any_other_field_is_refused_when_the_recipe_is_read(field):
    if field.startswith("hub_"):  # they act only with push_to_hub, which is refused
        refused(RecipeError, "push_to_hub", lambda: recipe.read({field: _other_value(_trl_fields()[field]),
                                                                 "push_to_hub": True}))
        return
    with pytest.raises(RecipeError, match=f"{field}="):
        recipe.read({field: _other_value(_trl_fields()[field])})


def test_the_table_is_the_fields_of_trl():
    fields = _trl_fields()
    assert recipe.USED <= set(fields) and set(recipe.MAPPED) <= set(fields)
    assert not recipe.USED & set(recipe.MAPPED)
    assert set(BEHAVIOUR) <= recipe.USED, set(BEHAVIOUR) - recipe.USED
    assert all(isinstance(e, type) and issubclass(e, GemportError) for e in (RecipeError, LoraError, MaskError))
    assert dataclasses.is_dataclass(recipe.Recipe)

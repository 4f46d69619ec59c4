"""Recipe fields fixed to TRL/HF's behaviour (issue 32): each against the peer that defines it.

One SFTRun is built from a ``trl sft`` YAML on a tiny Gemma 4 with a vision tower (``model_type: gemma4``, so
PEFT has a default for unset ``lora_target_modules``), with ``dtype``, ``chat_template_path`` and
``dataloader_drop_last`` set; nothing here trains.
"""

import dataclasses
import json
import re
import shutil

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from gemport.errors import LoraError, RecipeError, UnsafePathError
from gemport.data.training_template import gemma4_training_template
from gemport.mesh import make_mesh
from gemport.specs import GemmaSpec
from gemport import recipe
from gemport.run.record import RECIPE_FILE, check_resume, recipe_record
from gemport.run.sft import CHECKPOINTS, SFTRun, eval_batches
from gemport_cli import gemport, one_line_error
from chats import chats, tokenizer
from repo_paths import ROOT

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj"]}
MARKERS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")
RECIPE = dict(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=["q_proj", "k_proj", "v_proj"],
              dtype="float32", assistant_only_loss=True,
              max_length=128, per_device_train_batch_size=2, max_steps=2, save_steps=1, logging_steps=1,
              eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=2, dataloader_drop_last=True)


def plain_template():
    """The training template without its {% generation %} markers: the same text, no assistant masks (TRL's
    assistant_only_loss refuses such a template)."""
    return MARKERS.sub("", gemma4_training_template())


@pytest.fixture(scope="module")
def work(hf_checkpoint, tmp_path_factory):
    """A base folder (a Gemma4ForConditionalGeneration with a tokenizer whose template has no markers), the
    training template as a .jinja file, and the recipe YAML pointing at both."""
    _, saved = hf_checkpoint("gemma4_mesh", "conditional")
    root = tmp_path_factory.mktemp("fields")
    shutil.copytree(saved, root / "base")
    t = tokenizer()
    t.chat_template = plain_template()
    t.save_pretrained(root / "base")
    (root / "train.jinja").write_text(gemma4_training_template())
    (root / "sft.yaml").write_text(yaml.safe_dump({**RECIPE, "chat_template_path": str(root / "train.jinja"),
                                                   "output_dir": str(root / "out")}))
    return root


@pytest.fixture(scope="module")
def run(work):
    mesh = make_mesh(GemmaSpec.from_hf(work / "base"), fsdp=1, tp=1, devices=jax.devices()[:1])
    return SFTRun.create(work / "sft.yaml", work / "base", chats(8), eval_dataset=chats(5, seed=1), mesh=mesh,
                         progress=False)


def test_dtype_of_the_yaml_is_the_base_dtype(run):
    # bf16 is TRL's default, so without ModelConfig.dtype the base would load in bfloat16.
    dtypes = {p.dtype for p in jax.tree.leaves(nnx.state(run.model, nnx.Param))}
    assert dtypes == {np.dtype("float32")} and run.record["dtype"] == "float32"
    assert recipe.read({"dtype": "bfloat16", "bf16": False}).dtype() == np.dtype("bfloat16")
    assert recipe.read({"dtype": "auto", "bf16": False}).dtype() == np.dtype("float32")


def test_unset_target_modules_are_peft_defaults_for_the_architecture(work, tmp_path):
    """PEFT adapts q_proj and v_proj of a Gemma 4 (a regex over the language model); the run built from a recipe
    without lora_target_modules adapts the same modules with PEFT's trainable count, k_proj being a zero slot of
    Tunix's fused kv_einsum (trained equal to PEFT: tests/lora/test_peft_training.py, the ``+qv`` cases)."""
    import peft
    import transformers

    from gemport.lora import LoraLayout

    model = transformers.AutoModelForImageTextToText.from_pretrained(work / "base")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4))
    adapted = {n.removeprefix("base_model.model.model.language_model.") for n, m in wrapped.named_modules()
               if hasattr(m, "lora_A") and not n.endswith(("lora_A", "lora_B"))}
    assert {n.split(".")[-1] for n in adapted} == {"q_proj", "v_proj"}
    unset = yaml.safe_load((work / "sft.yaml").read_text())
    del unset["lora_target_modules"]
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({**unset, "output_dir": str(tmp_path / "out")}))
    assert recipe.read(tmp_path / "sft.yaml").lora()["target_modules"] is None
    mesh = make_mesh(GemmaSpec.from_hf(work / "base"), fsdp=1, tp=1, devices=jax.devices()[:1])
    run = SFTRun.create(tmp_path / "sft.yaml", work / "base", chats(8), eval_dataset=chats(5, seed=1), mesh=mesh,
                        progress=False)
    assert run.lora_spec.targets == ("q_proj", "v_proj")
    layout = LoraLayout(run.spec, run.lora_spec)
    assert {m for a in layout for m in a.hf_modules} == adapted
    assert layout.num_params == wrapped.get_nb_trainable_parameters()[0]
    assert any(0 in a.ranks for a in layout)  # kv_einsum's k_proj slot
    held = {".".join(map(str, p)): v.get_value().shape
            for p, v in nnx.to_flat_state(nnx.state(run.model, nnx.LoRAParam))}
    assert held == layout.shapes()
    # HF's count (trackers' model/num_parameters): the zero slots, held but no PEFT parameters, are not in it.
    base = sum(np.size(v) for v in jax.tree.leaves(nnx.state(run.model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))))
    assert run.num_parameters - base == layout.num_params < sum(np.prod(s) for s in held.values())


@pytest.mark.parametrize("name, kind", [("gemma3_1b", "causal"), ("gemma3_1b", "conditional"),
                                        ("gemma4_dense", "causal"), ("gemma4_dense", "conditional")])
def test_peft_default_targets_follow_peft(name, kind):
    import peft
    from tiny import causal_lm, conditional_generation

    from gemport.lora.config import peft_default_targets

    model = causal_lm(name) if kind == "causal" else conditional_generation(name)
    try:
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2))
    except ValueError as e:  # PEFT has no default for this model_type
        assert "target_modules" in str(e)
        with pytest.raises(LoraError, match="lora_target_modules is unset"):
            peft_default_targets(model.config.model_type)
        return
    adapted = {n.split(".")[-1] for n, m in wrapped.named_modules()
               if hasattr(m, "lora_A") and not n.endswith(("lora_A", "lora_B"))}
    assert all(".language_model." in n or kind == "causal" for n, m in wrapped.named_modules()
               if hasattr(m, "lora_A") and not n.endswith(("lora_A", "lora_B")))
    assert set(peft_default_targets(model.config.model_type)) == adapted


def test_eval_drops_the_last_partial_batch_as_hf(run, tmp_path):
    import datasets
    import transformers
    from tiny import causal_lm

    hf = transformers.Trainer(model=causal_lm("gemma3_1b"), args=transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=2, dataloader_drop_last=True, use_cpu=True,
        report_to="none"))
    expected = len(hf.get_eval_dataloader(datasets.Dataset.from_list([{"input_ids": [1, 2]}] * 5)))
    assert len(run.eval_examples) == 5 and len(run.eval_batches) == expected == 2
    assert all(b["loss_mask"][0].any(axis=1).all() for b in run.eval_batches)  # no empty row
    with pytest.raises(RecipeError, match="dataloader_drop_last drops all"):
        eval_batches(run.eval_examples[:1], 2, drop_last=True)


def test_chat_template_path_renders_and_masks_as_trl(run, work, tmp_path):
    """TRL with the base's own template (no markers) refuses assistant_only_loss; given chat_template_path (the
    training template) it trains the template's {% generation %} spans, which gemport's examples equal."""
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    model = transformers.AutoModelForImageTextToText.from_pretrained(work / "base")
    args = dict(output_dir=str(tmp_path), assistant_only_loss=True, max_length=128, report_to="none", use_cpu=True)
    trainer = SFTTrainer(model=model, args=SFTConfig(chat_template_path=str(work / "train.jinja"), **args),
                         processing_class=transformers.AutoTokenizer.from_pretrained(work / "base"),
                         train_dataset=datasets.Dataset.from_list(chats(8)))
    assert run.tokenizer.chat_template == gemma4_training_template()
    for example, row in zip(run.examples, trainer.train_dataset, strict=True):
        np.testing.assert_array_equal(example.tokens, row["input_ids"])
        np.testing.assert_array_equal(example.loss_mask, np.array(row["labels"]) != -100)


def _refused_before_loading(monkeypatch):
    import gemport.checkpoint
    from gemport.data.sft import SFTPipeline

    def never(*args, **kwargs):
        raise AssertionError("the model loaded or the data was tokenized before the field was refused")

    monkeypatch.setattr(gemport.checkpoint, "load_model", never)
    monkeypatch.setattr(SFTPipeline, "examples", never)


@pytest.mark.parametrize("template, words", [
    (lambda: "Hello " + gemma4_training_template(), "renders differently through the template"),
    (plain_template, "has no {% generation %} markers"),
    (lambda: "{% generation %}" + plain_template() + "{% endgeneration %}", "generation %} spans"),
    (lambda: "{{ messages[0]['content'] }}", "neither Gemma 3's"),
])
def test_chat_template_path_gemport_cannot_follow_is_refused(work, tmp_path, monkeypatch, template, words):
    _refused_before_loading(monkeypatch)
    (tmp_path / "t.jinja").write_text(template())
    with pytest.raises(RecipeError, match=re.escape("chat_template_path") + ".*" + re.escape(words)):
        SFTRun.create({**RECIPE, "chat_template_path": str(tmp_path / "t.jinja")}, work / "base", chats(8),
                      eval_dataset=chats(2), lora=LORA)


def test_chat_template_path_takes_a_tokenizer_folder_as_trl(work, tmp_path):
    import transformers
    from trl.chat_template_utils import clone_chat_template

    from gemport.data.chat_template import with_chat_template

    source = tokenizer()
    source.save_pretrained(tmp_path / "tok")
    base = transformers.AutoTokenizer.from_pretrained(work / "base")
    model = transformers.AutoModelForImageTextToText.from_pretrained(work / "base")
    rows = model.get_input_embeddings().weight.shape[0]
    model, cloned, added = clone_chat_template(model, base, str(tmp_path / "tok"))
    assert model.get_input_embeddings().weight.shape[0] == rows  # TRL leaves this model as is...
    assert len(cloned) == rows > len(source)  # ...and pads the tokenizer with <extra_id_*> tokens up to its rows
    ours = with_chat_template(transformers.AutoTokenizer.from_pretrained(work / "base"), tmp_path / "tok", rows)
    assert ours.chat_template == cloned.chat_template == gemma4_training_template()
    assert ours.get_vocab() == cloned.get_vocab() and ours.eos_token == cloned.eos_token
    base = transformers.AutoTokenizer.from_pretrained(work / "base")
    with pytest.raises(RecipeError, match=r"chat_template_path=.*resize the embeddings from 96 to 128"):
        with_chat_template(base, tmp_path / "tok", 96)  # TRL would resize a 96-row model's embeddings


def test_eos_token_outside_the_vocabulary_is_refused_as_trl(work, tmp_path, monkeypatch):
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    with pytest.raises(ValueError, match="eos_token.*not found in the vocabulary"):
        SFTTrainer(model=transformers.AutoModelForImageTextToText.from_pretrained(work / "base"),
                   args=SFTConfig(output_dir=str(tmp_path), eos_token="<nope>", report_to="none", use_cpu=True),
                   processing_class=transformers.AutoTokenizer.from_pretrained(work / "base"),
                   train_dataset=datasets.Dataset.from_list(chats(2)))
    _refused_before_loading(monkeypatch)
    with pytest.raises(RecipeError, match="eos_token='<nope>' is not in the tokenizer's vocabulary"):
        SFTRun.create({**RECIPE, "eos_token": "<nope>"}, work / "base", chats(8), eval_dataset=chats(2), lora=LORA)


def test_evaluation_without_an_eval_dataset_is_refused_as_hf(work, monkeypatch):
    """HF's Trainer refuses eval_strategy steps without an eval_dataset; so do SFTRun and DPORun, before the data
    is tokenized or the model loads (it was accepted and nothing evaluated)."""
    from gemport.run import DPORun

    _refused_before_loading(monkeypatch)
    for create in (SFTRun.create, DPORun.create):
        with pytest.raises(RecipeError, match="eval_strategy='steps' needs an eval dataset"):
            create({"eval_strategy": "steps"}, work / "base", chats(8), lora=LORA)


@pytest.mark.parametrize("field, value", [("eval_strategy", "epoch"), ("save_strategy", "epoch"),
                                          ("save_strategy", "best"), ("logging_strategy", "epoch"),
                                          ("logging_strategy", "no")])
def test_strategies_gemport_cannot_honour_are_refused_at_recipe_read(tmp_path, field, value):
    with pytest.raises(RecipeError, match=f"{field}={value!r}: gemport runs"):
        recipe.read({field: value})
    # SFTRun with a dict: refused before the base is even looked at (it does not exist here).
    with pytest.raises(RecipeError, match=f"{field}={value!r}"):
        SFTRun.create({field: value}, tmp_path / "no-base", chats(2), lora=LORA)


@pytest.mark.parametrize("where", ["base", "base/out", "data", "train.jinja"])
def test_sft_output_dir_inside_an_input_is_refused(work, tmp_path, where):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps(chats(1)[0]) + "\n")
    shutil.copy(work / "train.jinja", tmp_path / "train.jinja")
    (tmp_path / "base").symlink_to(work / "base")
    config = tmp_path / "sft.yaml"
    config.write_text(yaml.safe_dump({**RECIPE, "model_name_or_path": str(tmp_path / "base"),
                                      "dataset_name": str(tmp_path / "data"),
                                      "chat_template_path": str(tmp_path / "train.jinja"),
                                      "output_dir": str(tmp_path / where)}))
    one_line_error(gemport("sft", "--config", config, ok=False), "output", "input")


def test_a_rerun_resumes_only_the_same_recipe(run, work, tmp_path):
    record = run.record
    assert {"SFTConfig.learning_rate", "base", "dtype", "lora", "data"} <= set(record)
    assert "SFTConfig.output_dir" not in record and "SFTConfig.logging_steps" not in record
    # What the record tells apart: another learning rate (an override), other data, another LoRA.
    other = recipe_record({**run.args, "learning_rate": 1e-3}, base_dir=run.base_dir, dtype="float32",
                          lora_spec=run.lora_spec, qlora=None, examples=run.examples[::-1])
    assert {k for k in record if record[k] != other[k]} == {"SFTConfig.learning_rate", "data"}

    root = tmp_path / CHECKPOINTS
    check_resume(root, record, explicit=False)  # a fresh run records its recipe
    (root / "1").mkdir()
    check_resume(root, record, explicit=False)  # the same recipe resumes
    with pytest.raises(RecipeError, match=r"SFTConfig\.learning_rate: 2e-05 -> 0\.001; data: "):
        check_resume(root, other, explicit=False)
    check_resume(root, other, explicit=True)  # resume_from_checkpoint asks for it: the new recipe is recorded
    assert json.loads((root / RECIPE_FILE).read_text())["SFTConfig.learning_rate"] == 1e-3
    (root / RECIPE_FILE).unlink()
    with pytest.raises(RecipeError, match="checkpoints without gemport_recipe.json"):
        check_resume(root, record, explicit=False)

    # SFTRun.train checks before the trainer (which would restore the checkpoint) is built.
    (work / "out" / CHECKPOINTS / "1").mkdir(parents=True, exist_ok=True)
    (work / "out" / CHECKPOINTS / RECIPE_FILE).write_text(json.dumps(other))
    changed = dataclasses.replace(run, trainer=None)
    with pytest.raises(RecipeError, match="trained another recipe"):
        changed.train()
    assert changed.trainer is None


def test_port_gemma4_runs_on_the_devices_present_in_the_recipes_dtype(tmp_path):
    """The demo simulates 8 CPU devices only for the host platform (used when no accelerator is there) or on
    --cpu; a real checkpoint trains in the recipe's dtype (TRL's bf16), the miniature in float32."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = ROOT / "examples" / "port_gemma4.py"
    loader = importlib.util.spec_from_file_location("port_gemma4", path)
    demo = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(demo)

    env = demo.jax_environment(False, {})
    assert "JAX_PLATFORMS" not in env and "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
    assert demo.jax_environment(True, {})["JAX_PLATFORMS"] == "cpu"
    assert demo.jax_environment(False, {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}) == {}
    child = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = "import jax; print(jax.default_backend(), jax.device_count(), jax.devices('cpu')[0].platform)"
    seen = subprocess.run([sys.executable, "-c", code], env={**child, **env}, capture_output=True, text=True,
                          check=True).stdout.split()
    # JAX's own choice of platform: an accelerator where one is present (not forced to CPU), else 8 CPU devices.
    assert seen[2] == "cpu" and (seen[:2] == ["cpu", "8"] or seen[0] != "cpu")

    real = recipe.read(demo.sft_config(Path("gemma-4-31b-it"), 3, tmp_path))
    assert real.dtype() == np.dtype("bfloat16") and real.sft["max_steps"] == 3
    assert recipe.read(demo.sft_config(None, 3, tmp_path)).dtype() == np.dtype("float32")


def test_chat_template_path_checks_where_the_completion_mask_starts(tmp_path):
    """Prompt/completion conversations: TRL's completion mask starts where the prompt rendered with the generation
    prompt ends; a template whose generation prompt differs from gemport's is refused, naming the field."""
    from gemport.data.chat_template import check_records, with_chat_template
    from gemport.data.sft import from_sft_config

    records = [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in chats(6)]
    fmt = from_sft_config({}, tokenizer()).chat_format
    (tmp_path / "same.jinja").write_text(gemma4_training_template())
    assert check_records(records, with_chat_template(tokenizer(), tmp_path / "same.jinja", 128), fmt) == 6
    text = gemma4_training_template()
    prompt = "{{- '<|turn>model\\n' -}}"
    assert text.count(prompt) == 1
    (tmp_path / "other.jinja").write_text(text.replace(prompt, "{{- '<|turn>model\\n\\n' -}}"))
    with pytest.raises(RecipeError, match="chat_template_path: record 0: its prompt with the generation prompt"):
        check_records(records, with_chat_template(tokenizer(), tmp_path / "other.jinja", 128), fmt)

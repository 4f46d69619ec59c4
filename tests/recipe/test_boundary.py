"""One HF/TRL boundary: `gemport sft` and `gemport parity` accept exactly the same recipe files (one reader,
gemport.recipe.read), and no module outside gemport/recipe/ holds a copy of a recipe field's default."""

import ast
import json
from pathlib import Path

import pytest
import yaml

import gemport
from gemport import recipe
from gemport.cli import main
from gemport.errors import RecipeError
from gemport.check.parity import read_recipe

ROOT = Path(gemport.__file__).parent

VALID = {
    # What a TRL user sets; TRL's defaults for the rest (lora_dropout 0.05, bf16, gradient_checkpointing).
    "defaults.yaml": {"model_name_or_path": "google/gemma-3-1b-it", "dataset_name": "trl-lib/Capybara",
                      "use_peft": True, "lora_r": 8},
    # A tuned recipe with a mapped field (a note, no refusal) and a value older transformers wrote as a ratio.
    "tuned.yaml": {"model_name_or_path": "base", "use_peft": True, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
                   "lora_target_modules": ["q_proj", "v_proj"], "packing": True, "max_length": 512,
                   "learning_rate": 2e-4, "lr_scheduler_type": "cosine", "warmup_steps": 0.1,
                   "gradient_accumulation_steps": 4, "max_steps": 10, "bf16": False, "eval_strategy": "steps",
                   "eval_steps": 5, "attn_implementation": "flash_attention_2"},
    # JSON, which parity's help names beside YAML.
    "recipe.json": {"use_peft": True, "lora_r": 4, "lora_target_modules": ["q_proj"], "seed": 3},
}

INVALID = {
    "unknown": ({"use_peft": True, "learning_rat": 1e-4}, "learning_rat: not a field"),
    "refused when set": ({"use_peft": True, "fp16": True}, "fp16=True: TPUs compute in bfloat16"),
    "not reproduced": ({"use_peft": True, "label_smoothing_factor": 0.1}, "does not reproduce this field"),
    "bad strategy": ({"use_peft": True, "eval_strategy": "epoch"}, "eval_strategy='epoch'"),
}


def write(path: Path, fields) -> Path:
    path.write_text(json.dumps(fields) if path.suffix == ".json" else yaml.safe_dump(fields))
    return path


@pytest.mark.parametrize("name", sorted(VALID))
def test_a_recipe_sft_accepts_parity_accepts_alike(name, tmp_path):
    path = write(tmp_path / name, VALID[name])
    read = recipe.read(path)  # what `gemport sft --config` reads
    sft, lora = read_recipe(path)  # what `gemport parity --config` reads
    assert sft == {k: read.sft[k] for k in VALID[name] if k in read.sft}
    assert lora == read.lora() and lora["r"] == VALID[name]["lora_r"]
    assert lora["lora_dropout"] == VALID[name].get("lora_dropout", 0.05)  # trl sft's default, not PEFT's 0
    assert lora["lora_alpha"] == VALID[name].get("lora_alpha", recipe.defaults("ModelConfig")["lora_alpha"])


@pytest.mark.parametrize("case", sorted(INVALID))
def test_a_recipe_sft_refuses_parity_refuses_with_the_same_error(case, tmp_path, capsys):
    fields, match = INVALID[case]
    path = write(tmp_path / "recipe.yaml", fields)
    with pytest.raises(RecipeError, match=match) as by_reader:
        recipe.read(path)
    with pytest.raises(RecipeError) as by_parity:
        read_recipe(path)
    assert str(by_parity.value) == str(by_reader.value)
    # Both command lines, in process: each stops at the recipe, before anything loads, with the same line.
    assert main(["sft", "--config", str(path)]) == 2
    assert main(["parity", str(tmp_path / "base"), str(tmp_path / "data.jsonl"), "--config", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"gemport sft: error: {by_reader.value}", f"gemport parity: error: {by_reader.value}"]


# Dicts outside gemport/recipe/ keyed by recipe field names whose values equal those fields' defaults, that are no
# defaults table: each entry names the file and the field names, and says what the dict is.
NOT_DEFAULTS = {
    ("check/frame.py", frozenset({"report_to", "bf16", "fp16", "dataloader_num_workers", "push_to_hub", "eval_strategy"})):
        "GPU_OVERRIDES: what parity fixes on TRL's side whatever the recipe says",
    ("lora/config.py", frozenset({"use_dora"})): "LoraSpec.to_peft: the adapter_config.json gemport writes",
}


def _literal(node):
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def copied_defaults(root: Path) -> dict[tuple[str, frozenset], int]:
    """{(file, field names): line} of each dict literal (``{...}`` or ``dict(...)``) in the modules under ``root``
    outside ``recipe/`` that gives a recipe field (of TRL's or transformers' dataclasses) its owner's default."""
    owners = [recipe.defaults(o) for o in recipe.OWNERS]
    found = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("recipe/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                pairs = [(k.value, v) for k, v in zip(node.keys, node.values)
                         if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict":
                pairs = [(kw.arg, kw.value) for kw in node.keywords if kw.arg]
            else:
                continue
            names = set()
            for name, value in pairs:
                ok, value = _literal(value)
                for defaults in owners:
                    default = getattr(defaults.get(name), "value", defaults.get(name))
                    if ok and name in defaults and type(default) is type(value) and default == value:
                        names.add(name)
            if names:
                found[(relative, frozenset(names))] = node.lineno
    return found


def test_no_module_outside_the_recipe_package_copies_a_default():
    found = copied_defaults(ROOT)
    extra = {f"{file}:{line} {sorted(names)}" for (file, names), line in found.items()
             if (file, names) not in NOT_DEFAULTS}
    assert not extra, ("defaults of recipe fields copied outside gemport/recipe/ (read them with a "
                       f"gemport.recipe.Fields group): {extra}")
    assert set(NOT_DEFAULTS) <= set(found), "an entry of NOT_DEFAULTS names nothing: remove it"


def test_the_check_finds_a_copied_default(tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "order.py").write_text('_FIELDS = {"per_device_train_batch_size": 8, "seed": 42}\n'
                                                'OTHER = dict(logging_steps=1)\n')
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "fields.py").write_text('FALLBACK = {"learning_rate": 5e-5}\n')
    assert copied_defaults(tmp_path) == {("train/order.py", frozenset({"per_device_train_batch_size", "seed"})): 1}


def test_each_consumer_group_reads_fields_its_owner_has_and_the_table_uses():
    """Every field of a consumer's typed group (``recipe.Fields`` subclasses) is a field of its owner as installed
    (or a ``RETIRED`` one) and one the table counts as used: a group cannot read a field the reader refuses."""
    groups = recipe.Fields.__subclasses__()
    assert {g.__name__ for g in groups} == {"OptimizerFields", "OrderFields", "DataFields", "RunFields",
                                            "OutputsFields", "DPOLossFields", "PreferenceFields"}
    for group in groups:
        owner = set(recipe.defaults(group.owner)) | set(recipe.RETIRED)
        used = set(recipe.DPO) if group.owner == "DPOConfig" else set(recipe.SFT)
        assert set(group.names()) <= owner, (group, set(group.names()) - owner)
        assert set(group.names()) <= used, (group, set(group.names()) - used)
    complete = recipe.defaults("SFTConfig")
    assert recipe.RunFields.from_config(complete) == recipe.RunFields.from_config({})
    assert recipe.OrderFields.from_config({"seed": 7}).seed == 7

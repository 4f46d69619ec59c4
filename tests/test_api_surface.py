"""The public surface, pinned: what ``gemport`` and each subpackage export, and that the CLI needs nothing else.

A change here is an API change: update CHANGELOG.md and docs/api.md with it.
"""

import ast
import importlib
import re
from pathlib import Path

import pytest

import gemport
from repo_paths import ROOT

TOP_LEVEL = [
    "BatchError", "CheckpointError", "CheckpointWarning", "CorruptFileError", "DefaultsWarning", "EngineError", "GemmaSpec", "GemportError", "HFPeftTrainer", "LoraError", "LoraLayout",
    "LoraParams", "LoraSpec", "MaskError", "MeshError", "MissingDependencyError", "MissingTensorError",
    "OptimizerConfigError", "Preempted", "RecipeError", "SFTRun", "DPORun", "ShapeMismatchError", "SpecError", "TemplateMismatchError",
    "TemplateMismatchWarning", "TrainingError", "UnexpectedTensorError", "UnsafePathError", "VerifyError",
    "QLoraSpec", "apply_lora", "audit", "compare_logits", "export_merged", "export_peft", "fix_lora", "from_sft_config",
    "hf_optimizer", "import_peft", "load_hf", "load_model", "load_orbax", "load_qlora_model", "make_mesh", "memory_plan",
    "micro_batches", "optimizer_shardings", "optimizer_steps", "load_lora", "save_hf", "save_lora", "save_orbax",
    "train_step", "trajectory", "valid_meshes",
]  # fmt: skip

SUBPACKAGES = {
    "gemport.checkpoint": [
        "HFCheckpoint", "check_output", "export_merged", "export_peft", "import_peft", "load_hf", "load_model",
        "load_orbax", "load_qlora_model", "peft_for_vllm", "load_lora", "save_hf", "save_lora", "save_lora_spec",
        "save_orbax", "vllm_misserved",
    ],
    "gemport.check.vllm_offline": ["PYTHON_ENV", "Served", "max_lora_rank", "serve_vllm", "vllm_python"],
    "gemport.lora": [
        "PROJECTIONS", "VLLM_RANKS", "Adapter", "LoraLayout", "LoraParams", "LoraSpec", "Provider", "QLoraSpec",
        "apply_lora", "dropout_key", "factor_axes", "factor_specs", "lora_dropout", "provider",
    ],
    "gemport.mesh": ["Audit", "AuditRow", "LoraChange", "MeshError", "ShardedDim", "TpuSlice", "audit", "fix_lora",
                     "make_mesh", "optimizer_shardings", "sharded_dims", "slice_devices", "use_mesh", "valid_tp"],
    "gemport.plan": ["HBM", "DryRun", "MemoryPlan", "compiled_peak", "dry_run", "memory_plan", "valid_meshes"],
    "gemport.specs": ["GLOBAL", "SLIDING", "GemmaSpec"],
    "gemport.data": [
        "BATCH_FIELDS", "Decision", "Example", "Fitted", "FlatExamples", "Gemma3", "Gemma4", "LAYOUTS", "Labelled",
        "Layout", "MaskPolicy", "OptimizerStep", "Overflow", "PARTS", "Part", "Placement", "Preference", "ROLES",
        "Revision", "Role", "Rows", "SFTPipeline", "SamplingStrategy", "Segment", "StepBatches", "StepPlan", "Stream",
        "StreamBatches", "Thinking", "Train", "Truncation", "TruncationReport", "attention_mask", "build",
        "check_tokenizer", "collate", "encode", "from_sft_config", "optimizer_steps", "pack", "pad", "padding_free",
        "preferences", "prepare", "randperm", "sample_order", "split_prompt", "stack", "token_offsets",
        "trl_placement", "truncate", "tunix_inputs",
    ],
    "gemport.step": [
        "METRICS", "PAIR_LOSSES", "DPOLoss", "StepMetrics", "dpo_loss", "from_dpo_config", "loss_scopes",
        "masked_cross_entropy", "preference_loss", "segment_loss", "sequence_logps", "summed_cross_entropy",
        "train_step", "tunix_loss", "without_lora",
    ],
    "gemport.run": ["DPORun", "SFTRun"],
    "gemport.check": [],
    "gemport.cli": ["main"],
    "gemport.optim": [
        "AccumulateTokensState", "HFOptimizer", "Optim", "ScheduleName", "accumulate_tokens", "clip_grad_norm",
        "decay_mask", "decays", "hf_optimizer", "hf_schedule",
    ],
    "gemport.recipe": [
        "COMMANDS", "DEFAULT_ONLY", "DPO", "DPO_MAPPED", "MAPPED", "MODEL", "OWNERS", "QLORA", "REFUSED_WHEN_SET",
        "RETIRED", "SCRIPT", "SFT", "STRATEGIES", "TRL_LORA", "USED", "DataFields", "DPOLossFields", "Fields",
        "OptimizerFields", "OrderFields", "OutputsFields", "PreferenceFields", "Recipe", "RunFields", "check_strategies", "class_defaults",
        "defaults", "given", "owner_class", "parse_overrides", "read", "trainer_fields",
    ],
    "gemport.run.trainer": ["ACCUMULATION", "EXAMPLE_LOSS", "NUM_ITEMS", "SCOPES", "HFPeftTrainer", "eval_loss",
                                   "examples_in", "final_evaluation", "hf_loss", "micro_batches", "prefetched"],
    "gemport.data.distributed": ["batch_sharding", "device_rows", "global_batch", "process_rows", "process_step"],
    "gemport.run.preemption": ["Preempted", "Preemption"],
    "gemport.check.parity": ["GPU_OVERRIDES", "StepRow", "Tolerances", "Trajectory", "adapter_distances", "dropout_note", "miniature",
                       "read_recipe", "step_floors", "trajectory", "without_dropout"],
    "gemport.check.plots": ["loss_curves", "parity_dict", "parity_figure", "write_parity"],
    "gemport.run.trackers": [
        "MODULES", "TensorBoard", "Tracker", "Trackio", "Wandb", "hf_names", "installed", "names", "open_trackers",
        "run_config", "sft_config_dict",
    ],
    "gemport.check.verify": [
        "ContinuationReport", "LogitReport", "WITHIN", "compare_continuations", "compare_logits", "compare_vllm",
        "log_softmax", "logprob_floor", "model_dtype", "transformers_model", "tunix_logits",
    ],
    "gemport.run.dpo": ["DPORun", "dpo_fields", "eval_preference_batches", "preference_batches",
                        "preference_micro_batches"],
    "gemport.run.dpo_trainer": ["MICRO_BATCHES", "DPOPeftTrainer", "eval_loss", "trainer_loss"],
    "gemport.check.dpo_parity": ["ACCURACIES", "DPOTrajectory", "FLOORS", "MetricRow", "conversations", "trajectory"],
    "gemport.specs.names": ["AXES", "TEXT_PREFIXES", "Entry", "Rule", "detect_prefix", "entries", "owns"],
}  # fmt: skip


def test_top_level_namespace_is_pinned():
    assert sorted(gemport.__all__) == sorted(TOP_LEVEL)


def test_every_top_level_name_is_its_submodule_object():
    for name in gemport.__all__:
        value = getattr(gemport, name)
        home = importlib.import_module(value.__module__) if hasattr(value, "__module__") else gemport
        assert getattr(home, name) is value, name
    assert set(TOP_LEVEL) <= set(dir(gemport))


@pytest.mark.parametrize("module", sorted(SUBPACKAGES))
def test_subpackage_namespace_is_pinned(module):
    m = importlib.import_module(module)
    assert sorted(m.__all__) == sorted(SUBPACKAGES[module])
    for name in m.__all__:
        assert hasattr(m, name), f"{module}.{name}"


def _api_table_rows(heading):
    """The rows of the first table under ``heading`` in docs/api.md, as lists of cells."""
    text = (ROOT / "docs" / "api.md").read_text().split(f"\n{heading}\n", 1)[1]
    lines = [line for line in text.split("\n\n## ")[0].splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def test_the_api_reference_tables_are_the_top_level_namespace():
    """docs/api.md's table of the common flow and its table of errors name exactly ``gemport.__all__``, each in
    a module the row gives."""
    documented = set()
    for _, names, _, homes in _api_table_rows("## The top-level namespace"):
        for name in re.findall(r"`(\w+)`", names):
            modules = re.findall(r"`([\w.]+)`", homes)
            assert any(hasattr(importlib.import_module(m), name) for m in modules), (name, modules)
            documented.add(name)
    for names, _ in _api_table_rows("## Errors"):
        documented.update(n for n in re.findall(r"`(\w+)`", names) if hasattr(gemport.errors, n))
    documented.add("TemplateMismatchWarning")  # a warning, named in TemplateMismatchError's row
    assert documented == set(gemport.__all__)


def test_every_submodule_of_the_top_level_is_pinned():
    assert {f"gemport.{name}" for name in gemport._SUBMODULES} <= set(SUBPACKAGES)


def test_the_cli_uses_only_public_names():
    """Every ``from gemport.X import name`` in the CLI's modules names something in ``gemport.X.__all__`` (a
    public name where X has none; X outside the CLI), and no private attribute is read."""
    private = []
    for path in sorted((Path(gemport.__file__).parent / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gemport")
                    and not node.module.startswith("gemport.cli")):
                public = getattr(importlib.import_module(node.module), "__all__", None)
                private += [f"{node.module}.{a.name}" for a in node.names
                            if a.name not in gemport._SUBMODULES
                            and (a.name not in public if public is not None else a.name.startswith("_"))]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(ast.unparse(node))
    assert not private, f"the CLI uses non-public names: {private}"

"""``gemport sft --config sft.yaml --dry-run --tpu v5p-8``: a recipe checked whole before renting.

The run is built from ``config.json`` alone (no weights, no tokenizer: rows of ``max_length`` stand for the data),
its train step (the one ``SFTRun.train()`` runs, ``tests/plan/test_one_step.py``) compiled for the slice's chips with
libtpu on this host, and what a chip holds is reported against its HBM; nothing is written.
"""

import dataclasses
import importlib
import shutil

import jax
import yaml

from gemport import plan as plan_package
from gemport_cli import gemport, one_line_error


def _recipe(tmp_path, base, **fields):
    only = tmp_path / "config-only"
    only.mkdir(exist_ok=True)
    shutil.copy(base / "config.json", only / "config.json")
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({
        "model_name_or_path": str(only), "use_peft": True, "lora_r": 4, "lora_alpha": 8,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"], "max_length": 128,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "output_dir": str(tmp_path / "out"),
        **fields}))
    return path


def test_the_recipe_compiles_for_the_slice_from_config_json_alone(hf_checkpoint, tmp_path, monkeypatch):
    _, base = hf_checkpoint("gemma4_dense")
    reports = []
    real = plan_package.dry_run
    monkeypatch.setattr(plan_package, "dry_run", lambda run, **kw: reports.append(real(run, **kw)) or reports[-1])
    result = gemport("sft", "--config", _recipe(tmp_path, base), "--dry-run", "--tpu", "v5p-8")
    (report,) = reports
    # TRL's default gradient_checkpointing on a TPU: remat "projections" first, which fits (step.fit)
    assert report.platform == "tpu" and report.remat == "projections"
    assert (report.rows, report.seq_len) == (4, 128) and report.mesh == {"fsdp": 4, "tp": 1}
    assert 0 < report.argument_bytes < report.peak_bytes and report.fits and report.flops_per_token > 0
    out = result.stdout
    assert "of 95.00 GiB HBM: fits" in out and "GFLOPs per token in products" in out and "libtpu" in out, out
    assert report.uncounted == {"Pallas kernels"} and "(Pallas kernels not counted)" in out, out  # splash's
    assert "remat projections (libtpu; gradient_checkpointing's first of projections, decoder to fit)" in out, out
    assert not (tmp_path / "out").exists()  # nothing written
    # Past a chip's HBM the report says what to change, and the command exits 1.
    tight = dataclasses.replace(report, hbm_bytes=report.peak_bytes - 1, remat="none", rows=8,
                                batch_size=8)
    assert tight.fits is False
    for change in ("gradient_checkpointing: true", "per_device_train_batch_size 8", "a larger slice",
                   "max_length"):
        assert change in tight.advice(), tight.advice()


def test_a_step_libtpu_cannot_fit_is_an_error_saying_what_to_change(hf_checkpoint, tmp_path):
    """libtpu refuses to compile a program past the chip's HBM (RESOURCE_EXHAUSTED): the dry run says so in one
    line, with the micro-batch, the mesh and what to change, not libtpu's traceback."""
    _, base = hf_checkpoint("gemma4_dense")
    recipe = _recipe(tmp_path, base, per_device_train_batch_size=16384, gradient_checkpointing=False)
    one_line_error(gemport("sft", "--config", recipe, "--dry-run", "--tpu", "v5e-1", ok=False),
                   "16384 rows x 128 tokens", "fsdp=1 tp=1", "remat none", "does not fit the chips' memory",
                   "libtpu: RESOURCE_EXHAUSTED", "gradient_checkpointing: true", "per_device_train_batch_size 16384")
    assert not (tmp_path / "out").exists()


def test_a_remat_libtpu_refuses_gives_way_to_the_next(hf_checkpoint, tmp_path, monkeypatch):
    """As the trainer's first step does (tests/run/test_fit.py): the dry run reports the step that would train. The
    refusal is libtpu's message, raised for "projections" (libtpu's own takes minutes to reach at these widths)."""
    module = importlib.import_module("gemport.plan.dry_run")  # the package's dry_run is the function
    real = module.compile_step

    def refusing(trainer, *args, **kwargs):
        if trainer.model.remat == "projections":
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory "
                                             "in memory space hbm.")
        return real(trainer, *args, **kwargs)

    monkeypatch.setattr(module, "compile_step", refusing)
    _, base = hf_checkpoint("gemma4_dense")
    out = gemport("sft", "--config", _recipe(tmp_path, base), "--dry-run", "--tpu", "v5e-1").stdout
    assert ("remat decoder (libtpu; gradient_checkpointing's first of projections, decoder to fit; projections "
            "refused: RESOURCE_EXHAUSTED") in out and ": fits" in out, out


def test_tpu_is_for_a_dry_run(tmp_path, hf_checkpoint):
    _, base = hf_checkpoint("gemma4_dense")
    for command in ("sft", "dpo"):
        one_line_error(gemport(command, "--config", _recipe(tmp_path, base), "--tpu", "v5p-8", ok=False),
                       "--tpu v5p-8", "--dry-run")


def test_a_dpo_recipe_compiles_for_the_slice(dpo_workdir, tmp_path, monkeypatch):
    """``gemport dpo --dry-run --tpu v5p-8``: the DPO step (``tests/plan/test_one_step.py``) for the first step's pairs,
    [chosen; rejected] rows of the longest pair, compiled by libtpu; nothing written."""
    from dpo_command import write_recipe

    reports = []
    real = plan_package.dry_run
    monkeypatch.setattr(plan_package, "dry_run", lambda run, **kw: reports.append(real(run, **kw)) or reports[-1])
    out = tmp_path / "out"
    config = write_recipe(tmp_path / "dpo.yaml", dpo_workdir, output_dir=str(out), use_peft=True, lora_r=4,
                          lora_alpha=8, per_device_train_batch_size=2)
    result = gemport("dpo", "--config", config, "--dry-run", "--tpu", "v5p-8")
    (report,) = reports
    assert report.platform == "tpu" and report.remat == "projections" and report.rows == 4  # 2 pairs, 2 rows each
    assert 0 < report.argument_bytes < report.peak_bytes and report.fits and report.flops_per_token > 0
    assert "of 95.00 GiB HBM: fits" in result.stdout and "3 preference pairs" in result.stdout, result.stdout
    tight = dataclasses.replace(report, hbm_bytes=report.peak_bytes - 1)
    assert "per_device_train_batch_size 2;" in tight.advice(), tight.advice()  # the recipe's pairs, not its rows
    assert not out.exists()

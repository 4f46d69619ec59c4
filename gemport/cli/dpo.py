"""``gemport dpo --config dpo.yaml [--key value ...]``: a ``trl dpo`` recipe, unchanged, on the JAX devices present."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gemport import recipe as trl_recipe
from gemport.cli.training import (add_compile_cache, check_resume_point, compile_for_dry_run, report_dry_run,
                                  use_compile_cache, write_adapter)
from gemport.errors import MeshError, RecipeError

DESCRIPTION = """\
Run a `trl dpo --config dpo.yaml` recipe on the JAX devices present (a TPU slice; CPU for a miniature):
the same YAML (ScriptArguments, ModelConfig and DPOConfig fields) and the same `--key value` overrides.

What it does as TRL's DPOTrainer + PEFT does: the preference dataset (dataset_name as `gemport sft` reads
it; records with prompt/chosen/rejected or chosen/rejected, plain or conversational), TRL's tokens,
truncation (max_length, truncation_mode) and padding, DPO's loss (beta, loss_type, loss_weights,
label_smoothing), the reference being the base with the adapter disabled, HF's sample order and steps, AdamW,
schedule, clipping and gradient accumulation, logging every logging_steps, checkpoints every save_steps.

output_dir receives what a TRL user expects: trainer_state.json (log_history with loss, grad_norm,
learning_rate, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected; with eval_strategy steps, eval_loss and the eval_ metrics on dataset_test_split every
eval_steps), checkpoints/<step>, runs/ (TensorBoard, per report_to) and at the end adapter_config.json +
adapter_model.safetensors; --merge adds merged/. Running the command again resumes from the last complete
checkpoint, exactly, when the recipe is the one they trained; on SIGTERM the run saves the step it reaches and
exits with status 143.

Fields without a TPU counterpart are accepted and said; a field gemport does not reproduce
(precompute_ref_log_probs, sync_ref_model, the aot/sft loss types...), set away from TRL's default, is an
error naming it. docs/dpo.md lists every field."""

EPILOG = """\
examples:
  gemport dpo --config dpo.yaml
  gemport dpo --config dpo.yaml --beta 0.2 --max_steps 200 --output_dir out
  gemport dpo --config dpo.yaml --init-adapter sft_adapter/ --merge
  gemport dpo --config dpo.yaml --dry-run --tpu v5p-8"""


def add_parser(sub) -> None:
    """Register ``gemport dpo`` on the ``gemport`` subparsers."""
    c = sub.add_parser("dpo", help="run a `trl dpo --config` recipe (YAML + --key value overrides) on JAX devices",
                       usage="gemport dpo [--config dpo.yaml] [--key value ...] [--init-adapter DIR] [--merge] "
                             "[--fsdp N] [--tp N] [--dry-run [--tpu SLICE]] [--compile-cache DIR|off]",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    c.add_argument("--config", help="the recipe YAML, as `trl dpo --config` takes it")
    c.add_argument("--init-adapter", metavar="DIR",
                   help="start from this PEFT adapter (e.g. the SFT stage's), as TRL does when handed a PeftModel: "
                        "a frozen copy of it is the reference; its adapter_config.json replaces the lora_* fields")
    c.add_argument("--merge", action="store_true", help="also write output_dir/merged: the base with the adapter "
                                                        "merged in")
    c.add_argument("--fsdp", type=int, help="mesh fsdp size (default: from the plan)")
    c.add_argument("--tp", type=int, help="mesh tp size (default: the largest that fits)")
    c.add_argument("--dry-run", action="store_true",
                   help="train nothing: build the run from config.json and the data (no weight read), compile its "
                        "DPO step (chosen and rejected rows of the first step's pairs, the reference pass) and "
                        "print per chip what it holds, whether it fits and its FLOPs per token; exit 1 if it does "
                        "not fit. Nothing is written")
    c.add_argument("--tpu", metavar="SLICE", help="with --dry-run: compile for this TPU slice's chips (e.g. v5p-8; "
                                                  "libtpu's compiler on this host) instead of this host's devices")
    add_compile_cache(c)
    c.set_defaults(run=run, overrides=True)


def run(args) -> int:
    """``gemport dpo``: train the recipe, writing what TRL leaves in its output_dir (with ``--dry-run``, compile its
    step and say whether it fits). Exit status 0; 143 when preempted (SIGTERM); 1 from a dry run that does not fit."""
    if args.tpu and not args.dry_run:
        raise MeshError(f"--tpu {args.tpu} compiles for a slice this host is not: give it with --dry-run")
    if args.dry_run:
        compile_for_dry_run(args)
    cache = use_compile_cache(args)  # before anything compiles
    # Lazy: these load JAX (after --dry-run's environment), and --help stays cheap.
    from gemport.checkpoint.output import check_outside  # lazy: JAX; --help stays cheap
    from gemport.data.splits import load_splits  # lazy: JAX; --help stays cheap
    from gemport.run.dpo import DPORun  # lazy: JAX; --help stays cheap
    from gemport.run.lock import claim_output  # lazy: JAX; --help stays cheap
    from gemport.run.outputs import TRAINER_STATE  # lazy: JAX; --help stays cheap
    from gemport.run.preemption import Preempted  # lazy: JAX; --help stays cheap
    from gemport.run.sft import CHECKPOINTS  # lazy: JAX; --help stays cheap
    from gemport.run.trackers import names  # lazy: JAX; --help stays cheap
    from gemport.step.precision import describe  # lazy: JAX; --help stays cheap

    recipe = trl_recipe.read(args.config, trl_recipe.parse_overrides(args.extra), command="dpo")
    config, model, script = recipe.sft, recipe.model, recipe.script
    names(config["report_to"])  # each tracker named is installed, before anything loads
    base = model.get("model_name_or_path")
    if not base:
        raise RecipeError("model_name_or_path: not set; give the HF Gemma checkpoint directory")
    if not script.get("dataset_name"):
        raise RecipeError("dataset_name: not set; give a data file, folder, saved dataset or hub name")
    lora = recipe.lora()
    if args.init_adapter:
        lora = None
    elif lora is None:
        raise RecipeError("use_peft is not set: gemport dpo trains LoRA (the reference being the base with it "
                          "disabled); set use_peft: true with lora_r, lora_alpha and lora_target_modules, or pass "
                          "--init-adapter DIR")
    qlora = recipe.qlora()  # a 4-bit base gemport cannot reproduce is refused before anything loads
    if args.dry_run:
        return _dry_run(args, recipe, lora, qlora)
    output_dir = Path(config["output_dir"] or "trainer_output")  # HF's default
    config["output_dir"] = str(output_dir)
    check_outside(output_dir, *(p for p in (base, script["dataset_name"], args.init_adapter, args.config)
                                if p and Path(p).exists()))
    claim_output(output_dir)  # writable, and no other run in it: before anything long starts
    check_resume_point(config["resume_from_checkpoint"], output_dir / CHECKPOINTS)
    for note in recipe.notes:
        print(f"  {note}", flush=True)

    train_data, test_data = load_splits(script["dataset_name"], script.get("dataset_config"),
                                        train_split=script.get("dataset_train_split", "train"),
                                        test_split=script.get("dataset_test_split", "test"),
                                        with_test=config["eval_strategy"] != "no")
    dpo_run = DPORun.create(config, base, train_data, lora=lora, eval_dataset=test_data,
                            init_adapter=args.init_adapter, fsdp=args.fsdp,
                            tp=args.tp, dtype=recipe.dtype(), qlora=qlora, progress=not config["disable_tqdm"])
    spec, loss = dpo_run.lora_spec, dpo_run.loss
    print(f"data: {len(dpo_run.pairs)} preference pairs; {dpo_run.max_steps} optimizer steps of "
          f"{config['gradient_accumulation_steps']} x {config['per_device_train_batch_size']} pairs; "
          f"loss {'+'.join(loss.loss_types)} beta={loss.beta}; reference: "
          f"{'the starting adapter' if dpo_run.reference is not None else 'the base, LoRA off'}; mesh "
          f"{dict(dpo_run.mesh.shape)}; LoRA r={spec.rank} alpha={spec.alpha} on {', '.join(spec.targets)}; "
          f"{describe(dpo_run.precision)}" + (f"; {qlora}" if qlora else ""),
          flush=True)
    try:
        trainer = dpo_run.train()  # with HFOutputs in output_dir
    except Preempted as e:
        print(f"gemport dpo: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        if cache is not None:
            print(cache, flush=True)
            cache.close()
    print(f"trained to step {trainer.train_steps}; {output_dir / TRAINER_STATE}", flush=True)

    trained = dpo_run.lora_params()
    write_adapter(trained, output_dir, dpo_run.base_dir, base, merge=args.merge,
                  say=lambda line: print(line, flush=True))
    return 0


def _dry_run(args, recipe, lora, qlora) -> int:
    """Compile the run's DPO step (``gemport.plan.dry_run`` of an abstract ``DPORun``) and say whether it fits."""
    # Lazy: these load JAX, and --help stays cheap.
    from gemport.data.splits import load_splits  # lazy: JAX; --help stays cheap
    from gemport.mesh import make_mesh, slice_devices  # lazy: JAX; --help stays cheap
    from gemport.run.dpo import DPORun  # lazy: JAX; --help stays cheap
    from gemport.specs import GemmaSpec  # lazy: JAX; --help stays cheap

    config, script, base = recipe.sft, recipe.script, recipe.model["model_name_or_path"]
    data, _ = load_splits(script["dataset_name"], script.get("dataset_config"),
                          train_split=script.get("dataset_train_split", "train"), with_test=False)
    devices = slice_devices(args.tpu) if args.tpu else None
    mesh = make_mesh(GemmaSpec.from_hf(base), fsdp=args.fsdp, tp=args.tp, devices=devices)
    dpo_run = DPORun.create(config, base, data, lora=lora, init_adapter=args.init_adapter, mesh=mesh,
                            dtype=recipe.dtype(), qlora=qlora, progress=not config["disable_tqdm"], abstract=True)
    return report_dry_run(dpo_run, args.tpu, f"the first step of {len(dpo_run.pairs)} preference pairs",
                   lambda line: print(line, flush=True))


__all__ = ["DESCRIPTION", "add_parser", "run"]

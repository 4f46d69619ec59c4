"""``gemport sft --config sft.yaml [--key value ...]``: a ``trl sft`` recipe, unchanged, on the JAX devices present."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from gemport import recipe as trl_recipe
from gemport._src.extras import require
from gemport.cli.training import (add_compile_cache, check_resume_point, compile_for_dry_run, report_dry_run,
                                  use_compile_cache, write_adapter)
from gemport.errors import MeshError, RecipeError

DESCRIPTION = """\
Run a `trl sft --config sft.yaml` recipe on the JAX devices present (a TPU slice; CPU for a miniature):
the same YAML (ScriptArguments, ModelConfig and SFTConfig fields) and the same `--key value` overrides.

What it does as TRL does: the dataset (dataset_name: a .jsonl/.json/.parquet file, a folder of split
files, a saved `datasets` dataset, or a hub name; dataset_train_split / dataset_test_split), TRL's masks
(assistant_only_loss, completion_only_loss), truncation at max_length, packing / padding_free, HF's sample
order and steps, HF's AdamW, schedule, clipping and token-weighted gradient accumulation, evaluation every
eval_steps, logging every logging_steps, checkpoints every save_steps (save_total_limit kept).

output_dir receives what a TRL user expects: trainer_state.json (HF's log_history, rewritten at every
logging step), checkpoints/<step> (Orbax, with the LoRA spec), runs/ (TensorBoard, when report_to names
it) and at the end adapter_config.json + adapter_model.safetensors, as trainer.save_model() leaves them;
--merge adds merged/, the base with the adapter merged in (for vLLM); --plot adds loss.png, the training
and eval loss curves. report_to: tensorboard, wandb, trackio, all (those installed) or none, under HF's
metric names (train/loss, eval/loss, ...) with run_name and project; W&B reads WANDB_PROJECT, WANDB_MODE
(offline: no network), trackio TRACKIO_DIR. Running the command again resumes from the last complete
checkpoint, exactly, when the recipe is the one they trained (checkpoints/gemport_recipe.json); a changed
recipe is refused, naming what changed, unless resume_from_checkpoint is set. output_dir must lie outside
every input (model, data, --init-adapter, chat_template_path).

On SIGTERM (a spot / preemptible VM being reclaimed) the run saves the checkpoint of the step it reaches
and exits with status 143; the same command then resumes from it. A QLoRA recipe (load_in_4bit with
bnb_4bit_quant_type: nf4) trains on the 4-bit base, quantized as bitsandbytes does.

Past one host, run the same command on every host with --coordinator-address HOST0:PORT --num-processes N
--process-id I (or JAX_COORDINATOR_ADDRESS, or --distributed where JAX finds them itself: TPU pod slices,
SLURM). Every host needs the base, the data and the YAML at the same paths and output_dir on shared
storage; each lays out only its devices' rows, checkpoints are written by all, logs and exports by process 0.

Fields without a TPU counterpart (bf16, torch_compile, dataloader_num_workers, ...) are accepted
and said; a field gemport does not reproduce, set away from TRL's default, is an error naming it.
docs/sft.md lists every field."""

EPILOG = """\
examples:
  gemport sft --config sft.yaml
  gemport sft --config sft.yaml --learning_rate 1e-4 --max_steps 200 --output_dir out
  gemport sft --config sft.yaml --init-adapter gpu_adapter/ --merge
  gemport sft --config sft.yaml --fsdp 1 --tp 4
  gemport sft --config sft.yaml --dry-run --tpu v5p-8
  gemport sft --config sft.yaml --coordinator-address 10.0.0.2:8476 --num-processes 2 --process-id 0"""


def add_parser(sub) -> None:
    """Register ``gemport sft`` on the ``gemport`` subparsers."""
    c = sub.add_parser("sft", help="run a `trl sft --config` recipe (YAML + --key value overrides) on JAX devices",
                       usage="gemport sft [--config sft.yaml] [--key value ...] [--init-adapter DIR] [--merge] "
                             "[--plot] [--fsdp N] [--tp N] [--dry-run [--tpu SLICE]] "
                             "[--compile-cache DIR|off] "
                             "[--coordinator-address HOST:PORT --num-processes N "
                             "--process-id I | --distributed]",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    c.add_argument("--config", help="the recipe YAML, as `trl sft --config` takes it")
    c.add_argument("--init-adapter", metavar="DIR",
                   help="start from this PEFT adapter (e.g. trained on GPUs), as TRL does when handed a PeftModel; "
                        "its adapter_config.json replaces the recipe's lora_* fields")
    c.add_argument("--merge", action="store_true", help="also write output_dir/merged: the base with the adapter "
                                                        "merged in")
    c.add_argument("--plot", action="store_true", help="also write output_dir/loss.png: the training and eval loss "
                                                       "of trainer_state.json (pip install 'gemport[plot]')")
    c.add_argument("--fsdp", type=int, help="mesh fsdp size (default: from the plan)")
    c.add_argument("--tp", type=int, help="mesh tp size (default: the largest that fits)")
    c.add_argument("--dry-run", action="store_true",
                   help="train nothing: build the run from config.json alone (no weight read), compile its train "
                        "step for the first step's batch (max_length rows without dataset_name) and print per "
                        "chip what it holds, whether it fits and its FLOPs per token; exit 1 if it does not fit. "
                        "Nothing is written")
    c.add_argument("--tpu", metavar="SLICE", help="with --dry-run: compile for this TPU slice's chips (e.g. v5p-8; "
                                                  "libtpu's compiler on this host) instead of this host's devices")
    add_compile_cache(c)
    d = c.add_argument_group("several hosts (jax.distributed.initialize; one process per host)")
    d.add_argument("--coordinator-address", metavar="HOST:PORT",
                   help="process 0's address, the same on every host (default: $JAX_COORDINATOR_ADDRESS)")
    d.add_argument("--num-processes", type=int, metavar="N", help="the number of processes (hosts)")
    d.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 to N-1")
    d.add_argument("--distributed", action="store_true",
                   help="join a multi-process run whose settings JAX detects (TPU pod slices, SLURM, k8s)")
    c.set_defaults(run=run, overrides=True)


def _initialize(args) -> None:
    """Join the other processes (``jax.distributed.initialize``) when the command line or the environment asks,
    before anything touches the devices."""
    wanted = (args.distributed or args.coordinator_address or args.num_processes is not None
              or args.process_id is not None or os.environ.get("JAX_COORDINATOR_ADDRESS"))
    if wanted:
        import jax  # lazy: --help stays cheap

        jax.distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)


def run(args) -> int:
    """``gemport sft``: train the recipe, writing what TRL leaves in its output_dir (with ``--dry-run``, compile its
    step and say whether it fits). Exit status 0; 143 when preempted (SIGTERM); 1 from a dry run that does not fit."""
    if args.tpu and not args.dry_run:
        raise MeshError(f"--tpu {args.tpu} compiles for a slice this host is not: give it with --dry-run")
    if args.dry_run:
        compile_for_dry_run(args)
    _initialize(args)
    cache = use_compile_cache(args)  # before anything compiles
    # Lazy: these load JAX (after --dry-run's environment and jax.distributed), and --help stays cheap.
    import jax  # lazy: --help stays cheap

    from gemport.checkpoint.output import check_outside  # lazy: JAX; --help stays cheap
    from gemport.data.splits import load_splits  # lazy: JAX; --help stays cheap
    from gemport.run.lock import claim_output  # lazy: JAX; --help stays cheap
    from gemport.run.outputs import TRAINER_STATE  # lazy: JAX; --help stays cheap
    from gemport.run.preemption import Preempted  # lazy: JAX; --help stays cheap
    from gemport.run.sft import CHECKPOINTS, SFTRun  # lazy: JAX; --help stays cheap
    from gemport.run.trackers import names  # lazy: JAX; --help stays cheap
    from gemport.step.precision import describe  # lazy: JAX; --help stays cheap

    primary = jax.process_index() == 0

    def say(line: str) -> None:
        if primary:
            print(line, flush=True)

    recipe = trl_recipe.read(args.config, trl_recipe.parse_overrides(args.extra))
    sft, model, script = recipe.sft, recipe.model, recipe.script
    names(sft["report_to"])  # each tracker named is installed, before anything loads
    if args.plot:
        require("matplotlib", "gemport sft --plot")
    base = model.get("model_name_or_path")
    if not base:
        raise RecipeError("model_name_or_path: not set; give the HF Gemma checkpoint directory")
    if not script.get("dataset_name") and not args.dry_run:
        raise RecipeError("dataset_name: not set; give a data file, folder, saved dataset or hub name")
    lora = recipe.lora()
    if args.init_adapter:
        lora = None
    elif lora is None:
        raise RecipeError("use_peft is not set: gemport sft trains LoRA; set use_peft: true with lora_r, lora_alpha "
                        "and lora_target_modules, or pass --init-adapter DIR")
    if args.dry_run:
        return _dry_run(args, recipe, lora, say)
    output_dir = Path(sft["output_dir"] or "trainer_output")  # HF's default
    sft["output_dir"] = str(output_dir)
    inputs = (base, script["dataset_name"], args.init_adapter, sft["chat_template_path"], args.config)
    check_outside(output_dir, *(p for p in inputs if p and Path(p).exists()))
    if primary:  # writable, and no other run in it: before anything long starts
        claim_output(output_dir)
    check_resume_point(sft["resume_from_checkpoint"], output_dir / CHECKPOINTS)
    qlora = recipe.qlora()
    for note in recipe.notes:
        say(f"  {note}")

    train_data, test_data = load_splits(
        script["dataset_name"], script.get("dataset_config"),
        train_split=script.get("dataset_train_split", "train"), test_split=script.get("dataset_test_split", "test"),
        with_test=sft["eval_strategy"] != "no", streaming=bool(script.get("dataset_streaming")))
    sft_run = SFTRun.create(sft, base, train_data, lora=lora, eval_dataset=test_data, init_adapter=args.init_adapter,
                            fsdp=args.fsdp, tp=args.tp, dtype=recipe.dtype(), qlora=qlora,
                            progress=not sft["disable_tqdm"])
    report = sft_run.report
    dropped = report.dropped_too_long + report.dropped_no_target
    total = dropped + len(sft_run.examples)
    lora_spec = sft_run.lora_spec
    kept = f"{len(sft_run.examples)} of {total} examples kept" + (
        " in the stream's first packing batch" if sft_run.plan.num_samples is None else "")
    say(f"data: {kept} ({report}); {sft_run.max_steps} optimizer steps "
        f"of {sft['gradient_accumulation_steps']} x {sft['per_device_train_batch_size']} "
        f"({sft_run.pipeline.layout}); mesh {dict(sft_run.mesh.shape)}; LoRA r={lora_spec.rank} "
        f"alpha={lora_spec.alpha} on {', '.join(lora_spec.targets)}; {describe(sft_run.precision)}"
        + (f"; {qlora}" if qlora else "")
        + (f"; {jax.process_count()} processes" if jax.process_count() > 1 else ""))
    if dropped or report.trimmed:
        say(f"warning: max_length {sft_run.pipeline.max_length} drops {dropped} of {total} examples "
            f"({dropped / total:.0%}) and trims {report.trimmed}, losing {report.targets_lost} trained targets; "
            "raise max_length to keep them")
    try:
        trainer = sft_run.train()  # with HFOutputs in output_dir
    except Preempted as e:
        print(f"gemport sft: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    finally:
        if cache is not None:
            say(str(cache))
            cache.close()
    say(f"trained to step {trainer.train_steps}; {output_dir / TRAINER_STATE}")

    trained = sft_run.lora_params()  # on every process: gathered from all of them
    if not primary:
        return 0
    write_adapter(trained, output_dir, sft_run.base_dir, base, merge=args.merge, say=say)
    if args.plot:
        from gemport.check.plots import loss_curves  # lazy: JAX; --help stays cheap

        say(f"wrote {loss_curves(output_dir / TRAINER_STATE, output_dir / 'loss.png')}")
    return 0


def _dry_run(args, recipe, lora, say) -> int:
    """Compile the run's train step (``gemport.plan.dry_run`` of an abstract ``SFTRun``) and say whether it fits."""
    # Lazy: these load JAX, and --help stays cheap.
    from gemport.data.splits import load_splits  # lazy: JAX; --help stays cheap
    from gemport.mesh import make_mesh, slice_devices  # lazy: JAX; --help stays cheap
    from gemport.run.sft import SFTRun  # lazy: JAX; --help stays cheap
    from gemport.specs import GemmaSpec  # lazy: JAX; --help stays cheap

    sft, script = recipe.sft, recipe.script
    base = recipe.model["model_name_or_path"]
    data = None
    if script.get("dataset_name"):
        data, _ = load_splits(script["dataset_name"], script.get("dataset_config"),
                              train_split=script.get("dataset_train_split", "train"), with_test=False)
    devices = slice_devices(args.tpu) if args.tpu else None
    mesh = make_mesh(GemmaSpec.from_hf(base), fsdp=args.fsdp, tp=args.tp, devices=devices)
    sft_run = SFTRun.create(sft, base, data, lora=lora, init_adapter=args.init_adapter, mesh=mesh,
                            dtype=recipe.dtype(), qlora=recipe.qlora(), progress=not sft["disable_tqdm"],
                            abstract=True)
    return report_dry_run(sft_run, args.tpu,
                          "the first step of the data" if data is not None else "rows of max_length", say)


__all__ = ["DESCRIPTION", "add_parser", "run"]

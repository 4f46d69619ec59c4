"""The ``gemport`` command line: a thin layer over the library. ``gemport COMMAND --help`` for each command."""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import tempfile
from pathlib import Path

from gemport.cli.dpo import add_parser as add_dpo_parser
from gemport.cli.sft import add_parser as add_sft_parser
from gemport.errors import CheckpointError, GemportError, LoraError, MeshError, RecipeError, SpecError


class Default:
    """An option's default, read from the library function's signature when it is shown (``--help``), so the
    CLI never repeats a library default and parsing stays cheap (no JAX import)."""

    def __init__(self, function: str, parameter: str):
        self.function, self.parameter = function, parameter

    def __str__(self):
        module, name = self.function.rsplit(".", 1)
        return str(inspect.signature(getattr(importlib.import_module(module), name)).parameters[self.parameter].default)


def _given(args, **names: str) -> dict:
    """``{parameter: args.<option>}`` for the options the user gave; the library's defaults apply to the rest."""
    return {param: getattr(args, opt) for param, opt in names.items() if not isinstance(getattr(args, opt), Default)}


def _add_lora_source(c, what: str) -> None:
    """The options that name where LoRA factors come from, shared by ``export`` and ``verify``."""
    c.add_argument("--step", type=int, help=f"{what} step (default: latest)")
    c.add_argument("--lora-config", help="a PEFT adapter_config.json or its directory, if gemport did not record "
                                         "the LoRA spec beside the checkpoint")


def _spec(model: str):
    from gemport.specs import GemmaSpec

    return GemmaSpec.from_hf(model) if Path(model).exists() else GemmaSpec.preset(model)


def _check_out(args) -> Path:
    """The output, refused if it is or lies inside any input of the command (see ``check_output``)."""
    from gemport.checkpoint import check_output

    inputs = [getattr(args, name, None) for name in ("src", "base", "lora", "adapter", "model", "spec", "base_dir",
                                                     "lora_config")]
    return check_output(args.out, *(p for p in inputs if p and Path(p).exists()))


def _kind(src: Path) -> str:
    """``"hf"`` or ``"orbax"``: what ``gemport convert`` was given (anything without HF files is taken for Orbax,
    whose reader then names what is missing)."""
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such directory; pass an HF checkpoint directory or an Orbax checkpoint")
    if (src / "config.json").is_file():
        return "hf"
    if any(src.glob("*.safetensors")) or (src / "model.safetensors.index.json").is_file():
        raise CheckpointError(f"{src}: HF safetensors without config.json; copy the model's config.json beside them")
    return "orbax"


def _lora_spec(path: str | None):
    from gemport.lora import LoraSpec

    return LoraSpec.from_peft(path) if path else None


def plan(args) -> int:
    from gemport.plan import valid_meshes

    if args.lora_rank is not None and args.lora_rank < 1:
        raise LoraError(f"--lora-rank {args.lora_rank}: a LoRA rank is a positive integer (omit it for full "
                        "fine-tuning)")
    spec = _spec(args.model)
    hbm = int(args.hbm) if args.hbm and args.hbm.isdigit() else args.hbm
    devices = args.devices
    if args.tpu:
        from gemport.mesh import TpuSlice

        tpu = TpuSlice.parse(args.tpu)
        if args.devices not in (None, tpu.chips):
            raise MeshError(f"--devices {args.devices} disagrees with --tpu {tpu.name}, which has {tpu.chips} chips; "
                            "give one of them")
        devices, hbm = tpu.chips, hbm or tpu.generation
    elif devices is None:
        raise MeshError("give the slice: --tpu (e.g. v5p-8) or --devices (its chip count)")
    if (args.batch is None) != (args.seq_len is None):
        raise MeshError("plan the train step with both --batch and --seq-len, or neither")
    lora = _lora_spec(args.lora_config)
    if lora is None and args.lora_rank is not None:
        from gemport.lora import LoraSpec

        lora = LoraSpec(args.lora_rank)  # alpha scales the delta, not its memory
    qlora = None
    if args.qlora:
        from gemport.lora import QLoraSpec

        qlora = QLoraSpec(qtype=args.qlora, double_quant=args.double_quant)
        if lora is None:
            raise LoraError("--qlora trains LoRA on the 4-bit base: give --lora-rank or --lora-config")
    if args.compile and "JAX_PLATFORMS" not in os.environ:
        import jax

        # Compiling needs no accelerator, and a plan must not take (or wait for) the one a run may hold.
        jax.config.update("jax_platforms", "cpu")
    if args.compile and not args.tpu:
        from gemport.plan.compiled import CPU_MEMORY_SCHEDULER

        # Read when JAX's CPU backend starts: in a fresh process, before anything has run.
        flags = os.environ.get("XLA_FLAGS", "")
        if "host_platform_device_count" not in flags:
            flags += f" --xla_force_host_platform_device_count={devices}"
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_MEMORY_SCHEDULER}".strip()
    plans = valid_meshes(spec, devices, hbm_bytes=hbm, lora_spec=lora, batch=args.batch, seq_len=args.seq_len,
                         qlora=qlora, **_given(args, param_dtype="param_dtype", remat="remat"))
    base = f"a 4-bit ({qlora.qtype}) base" if qlora else f"a {args.param_dtype} base"
    where = f"a {args.tpu} ({devices} chips)" if args.tpu else f"{devices} devices"
    print(f"{args.model}: {len(plans)} valid (fsdp, tp) meshes on {where}, {base}")
    for p in plans:
        print(f"  {p}")
        if p.tunix_line:
            print(f"    {p.tunix_line}")
        if args.compile:
            print(f"    {_compiled_peak(spec, lora, qlora, p, args)}")
    return 0


def _compiled_peak(spec, lora, qlora, p, args) -> str:
    """The compiled peak per device of the train step on plan ``p``'s mesh: of the TPU slice's chips (libtpu's
    compiler) with --tpu, else of this host's CPU devices."""
    from gemport.plan import compiled_peak

    if lora is None or args.batch is None:
        raise MeshError("--compile compiles the LoRA train step: give --lora-rank or --lora-config, --batch and "
                        "--seq-len")
    try:
        peak = compiled_peak(spec, lora, p.fsdp, p.tp, batch=args.batch, seq_len=args.seq_len, qlora=qlora,
                             tpu=args.tpu, remat=p.step.remat, **_given(args, param_dtype="param_dtype"))
    except MeshError as e:
        return f"not compiled: {e}"
    compiler = f"TPU {args.tpu}, libtpu's compiler" if args.tpu else "XLA:CPU"
    return f"compiled peak ({compiler}, the step SFTRun.train() runs): {peak / 2**30:.2f} GiB ({peak} bytes) per device"


def convert(args) -> int:
    from gemport.checkpoint import load_hf, load_orbax, save_hf, save_orbax

    src = Path(args.src)
    _check_out(args)
    if _kind(src) == "hf":
        out = save_orbax(load_hf(src, param_dtype=args.param_dtype), args.out)
    else:
        if not (args.spec or args.base_dir):
            raise SpecError(f"{src} is an Orbax checkpoint: pass --spec (HF dir or preset) or --base-dir")
        spec = _spec(args.spec or args.base_dir)
        out = save_hf(load_orbax(src, spec=spec, param_dtype=args.param_dtype), args.out, base_dir=args.base_dir,
                      spec=spec, **_given(args, max_shard_size="max_shard_size"))
    print(f"wrote {out}")
    return 0


def export(args) -> int:
    from gemport.checkpoint import export_merged, export_peft

    _check_out(args)
    lora_spec = _lora_spec(args.lora_config)
    if args.format == "merged":
        out = export_merged(args.lora, args.out, base_dir=args.base, lora_spec=lora_spec, step=args.step,
                            **_given(args, max_shard_size="max_shard_size"))
    else:
        out = export_peft(args.lora, args.out, base_dir=args.base, lora_spec=lora_spec, step=args.step,
                          base_model_name_or_path=args.base_model_name)
    print(f"wrote {out}")
    return 0


def import_peft(args) -> int:
    from gemport.checkpoint import import_peft as read_adapter
    from gemport.checkpoint import save_lora

    _check_out(args)
    lora = read_adapter(args.adapter, spec=_spec(args.model))
    out = save_lora(lora, args.out)
    spec = lora.lora_spec
    print(f"wrote {out} (step 0, rank {spec.rank}, alpha {spec.alpha}, fused {spec.fused})")
    return 0


def verify(args) -> int:
    from gemport.checkpoint import load_model, load_lora
    from gemport.lora import apply_lora
    from gemport.check.verify import compare_logits

    hf_dir, adapter = Path(args.hf_dir), None
    # --engine tunix: both sides in the dtype; --engine vllm: vLLM's, beside float32 references.
    dtype = str(args.dtype)
    tunix_dtype = dtype if args.engine == "tunix" else "float32"
    if (hf_dir / "adapter_config.json").is_file():
        if not args.base:
            raise CheckpointError(f"{hf_dir} is a PEFT adapter: pass --base, the checkpoint it adapts")
        adapter, hf_dir = hf_dir, Path(args.base)
    if args.lora:
        base = Path(args.base or hf_dir)
        spec = _spec(str(base))
        lora = load_lora(args.lora, lora_spec=_lora_spec(args.lora_config), step=args.step)
        model = apply_lora(load_model(base, spec=spec, param_dtype=tunix_dtype), spec, lora)
    elif args.engine == "vllm":
        model = None
    else:
        model = load_model(hf_dir, param_dtype=tunix_dtype)
    if args.engine == "vllm":
        return _verify_vllm(args, hf_dir, adapter, model)
    report = compare_logits(hf_dir, model, adapter_dir=adapter, dtype=dtype,
                            **_given(args, seq_len="seq_len", within="within", atol="atol"))
    print(report)
    return 0 if report.ok else 1


def _verify_vllm(args, hf_dir: Path, adapter: Path | None, tunix_model) -> int:
    from gemport.checkpoint import vllm_misserved
    from gemport.check.verify import compare_vllm

    misserved = vllm_misserved(adapter, spec=_spec(str(hf_dir))) if adapter else []
    if misserved:
        print(f"vLLM serves V without k_proj's delta on the k_eq_v layers of {', '.join(misserved)} (no v_proj "
              f"copy; transformers + PEFT give V that delta): `gemport peft-for-vllm {adapter} {hf_dir} OUT` writes "
              "the adapter vLLM serves exactly")
    reports = compare_vllm(hf_dir, adapter_dir=adapter, tunix_model=tunix_model, python=args.vllm_python,
                           **_given(args, num_prompts="prompts", seq_len="seq_len", max_tokens="max_tokens",
                                    within="within", atol="atol", dtype="dtype"))
    for report in reports:
        print(report)
    return 0 if all(r.ok for r in reports) else 1


def peft_for_vllm(args) -> int:
    from gemport.checkpoint import peft_for_vllm as rewrite

    _check_out(args)
    out, added = rewrite(args.adapter, args.out, spec=_spec(args.model))
    print(f"wrote {out} (" + (f"v_proj copies of k_proj on {len(added)} k_eq_v layers: {', '.join(added)}"
                              if added else "vLLM serves it as it was: nothing added") + ")")
    return 0


def parity(args) -> int:
    """``gemport parity``: the trainer's comparison (checked whole first), on the base or its miniature;
    parity.json and parity.png in ``--out``, the table printed. Exit status 1 on a disagreement."""
    from gemport.cli.dpo import parity_comparison as dpo_comparison
    from gemport.check.parity import miniature
    from gemport.check.plots import write_parity

    compare = (dpo_comparison if args.trainer == "dpo" else _sft_comparison)(args)  # before anything trains
    with tempfile.TemporaryDirectory(prefix="gemport-miniature-") as work:
        base, tokenizer = args.base, None
        if args.miniature:
            import transformers

            tokenizer = transformers.AutoTokenizer.from_pretrained(args.base)
            base = miniature(args.base, Path(work) / "miniature", vocab_size=args.vocab_size)
            print(f"miniature of {args.base}: {base}")
        report = compare(base, tokenizer)
    numbers, picture = write_parity(report, args.out)
    print(f"wrote {numbers}" + (f", {picture}" if picture else
                                 " (parity.png needs matplotlib: pip install 'gemport[plot]')"))
    print(report.table())
    return 0 if report.ok else 1


def _sft_comparison(args):
    """The SFT recipe's comparison, ``(base, tokenizer) -> parity.Trajectory``, its recipe read and checked."""
    from gemport.check.parity import Tolerances, dropout_note, read_recipe, trajectory, without_dropout
    from gemport.step import segment_loss, tunix_loss

    sft, lora = read_recipe(args.config)
    if args.lora_config:
        lora = args.lora_config
    if not lora:
        raise RecipeError(f"{args.config}: no lora_r/lora_target_modules; pass --lora-config adapter_config.json")
    lora, dropout = without_dropout(lora)
    if dropout:
        print(dropout_note(dropout))
    port = read_recipe(args.port_config)[0] if args.port_config else None
    if args.dtype == "float32" and sft.get("bf16", not sft.get("fp16")):  # TRL: bf16 unless fp16
        print(f"{args.config} trains in bfloat16 (bf16, TRL's default): compared in float32, where a disagreement is "
              "in what is computed; --dtype bfloat16 compares it in bfloat16, against the bfloat16 floor")
    # Each step is judged against the floor measured in the run, unless --rtol fixes a bound.
    tolerances = Tolerances(loss=args.rtol, grad_norm=args.rtol, adapter=args.adapter_rtol)
    return lambda base, tokenizer: trajectory(
        base, args.data, sft_config=sft, lora_config=lora, steps=args.steps, tokenizer=tokenizer,
        port_sft_config=port, loss_fn={"segment": segment_loss, "tunix": tunix_loss}[args.loss], dtype=args.dtype,
        tolerances=tolerances)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gemport", description="Port Gemma LoRA fine-tuning between HF and Tunix.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = "an HF checkpoint directory or a preset name (e.g. gemma4-31b)"

    c = sub.add_parser("plan", help="valid (fsdp, tp) meshes and per-device memory for a model",
                       description="List every valid (fsdp, tp) mesh for a model on N devices with what each "
                                   "device holds: base params, LoRA params, Adam moments.")
    c.add_argument("model", help=model_help)
    c.add_argument("--tpu", metavar="SLICE", help="a Cloud TPU slice (v5p-8, v6e-8, v5litepod-16, ...): its chips and "
                                                  "their HBM; with --compile, compile for its chips (libtpu's "
                                                  "compiler, on this host: pip install 'gemport[tpu]')")
    c.add_argument("--devices", type=int, help="number of chips (v5p-8: 4, v6e-8: 8), when not given by --tpu")
    c.add_argument("--hbm", help="HBM per chip: a chip name (v4, v5e, v5p, v6e) or bytes (default: --tpu's chip)")
    c.add_argument("--lora-rank", type=int, help="LoRA rank on all seven projections (omit both LoRA options for "
                                                 "full fine-tuning)")
    c.add_argument("--lora-config", help="a PEFT adapter_config.json or its directory: targets and per-module ranks")
    c.add_argument("--param-dtype", default=Default("gemport.plan.memory_plan", "param_dtype"),
                   help="parameter dtype (default %(default)s)")
    c.add_argument("--qlora", metavar="QTYPE", help="QLoRA: the projections on a 4-bit base as load_qlora_model "
                                                   "places it (bitsandbytes' bnb_4bit_quant_type: nf4)")
    c.add_argument("--double-quant", action="store_true",
                   help="with --qlora: bitsandbytes' bnb_4bit_use_double_quant (same memory: scales stay float32)")
    c.add_argument("--batch", type=int, help="rows per train step, all devices together (with --seq-len: add the "
                                             "step's gradients, activations, logits)")
    c.add_argument("--seq-len", type=int, help="tokens per row")
    c.add_argument("--remat", default=Default("gemport.plan.memory_plan", "remat"),
                   help="Tunix remat_config of the step, a RematConfig name in lower case (default %(default)s)")
    c.add_argument("--compile", action="store_true",
                   help="also lower and compile the LoRA train step for abstract inputs, for --tpu's chips or else "
                        "this host's CPU (nothing allocated; a minute or more at real widths), and print its "
                        "compiled peak per device")
    c.set_defaults(run=plan)

    c = sub.add_parser("convert", help="HF safetensors <-> Orbax Tunix parameters",
                       description="An HF checkpoint directory becomes an Orbax checkpoint of the Tunix "
                                   "parameters; an Orbax checkpoint becomes HF safetensors.")
    c.add_argument("src", help="an HF checkpoint directory, or an Orbax checkpoint")
    c.add_argument("out", help="the output directory (must not exist)")
    c.add_argument("--spec", help=f"for Orbax -> HF: {model_help}")
    c.add_argument("--base-dir", help="for Orbax -> HF: the original HF checkpoint (keeps its layout and files)")
    c.add_argument("--param-dtype", help="parameter dtype, e.g. bfloat16 (default: keep)")
    c.add_argument("--max-shard-size", default=Default("gemport.checkpoint.save_hf", "max_shard_size"),
                   help="HF shard size (default %(default)s)")
    c.set_defaults(run=convert)

    c = sub.add_parser("export", help="Orbax LoRA -> merged HF safetensors or a PEFT adapter",
                       description="Export LoRA params trained with Tunix (a PeftTrainer checkpoint) for the GPU "
                                   "world: merged into the base (for vLLM) or as a PEFT adapter.")
    c.add_argument("base", help="the HF checkpoint the adapter was trained on")
    c.add_argument("lora", help="the PeftTrainer checkpoint root, a step, or a model_params directory")
    c.add_argument("out", help="the output directory (must not exist)")
    c.add_argument("--format", choices=("merged", "peft"), default="merged", help="default merged")
    _add_lora_source(c, "checkpoint")
    c.add_argument("--base-model-name", help="base_model_name_or_path for the PEFT adapter (default: base path)")
    c.add_argument("--max-shard-size", default=Default("gemport.checkpoint.export_merged", "max_shard_size"),
                   help="merged shard size (default %(default)s)")
    c.set_defaults(run=export)

    c = sub.add_parser("import-peft", help="a PEFT adapter -> Orbax LoRA params for Tunix",
                       description="Read a PEFT LoRA adapter trained on GPUs as Qwix LoRA params, saved as a "
                                   "PeftTrainer-style checkpoint (<out>/0/model_params) with its LoRA spec.")
    c.add_argument("adapter", help="the PEFT adapter directory")
    c.add_argument("model", help=model_help)
    c.add_argument("out", help="the output checkpoint root (must not exist)")
    c.set_defaults(run=import_peft)

    c = sub.add_parser("verify", help="compare Tunix and transformers logits",
                       description="Run the same tokens through transformers and Tunix and report the largest "
                                   "logit difference. HF_DIR alone: the checkpoint against its Tunix load. With "
                                   "--base and --lora: an export (merged dir or PEFT adapter) against Tunix "
                                   "with the LoRA. The distance is judged against a floor measured on the same tokens "
                                   "(N x the floor); exit status 1 when they disagree beyond --within (or --atol).")
    c.add_argument("hf_dir", help="an HF checkpoint, a merged export, or a PEFT adapter")
    c.add_argument("--base", help="the base HF checkpoint (for an export or an adapter)")
    c.add_argument("--lora", help="the Orbax LoRA checkpoint the export came from")
    _add_lora_source(c, "--lora checkpoint")
    c.add_argument("--seq-len", type=int, default=Default("gemport.check.verify.compare_logits", "seq_len"),
                   help="tokens per row (default %(default)s)")
    c.add_argument("--within", type=float, default=Default("gemport.check.verify.compare_logits", "within"),
                   help="agree within this multiple of the floor measured on the same tokens (transformers eager "
                        "vs sdpa in float32; transformers bfloat16 vs float32 in bfloat16): on logits with --engine "
                        "tunix, on log-probabilities with --engine vllm (default %(default)s)")
    c.add_argument("--atol", type=float,
                   help="a fixed tolerance chosen instead of --within (the floor is still reported): max-abs on "
                        "logits with --engine tunix, on log-probabilities with --engine vllm")
    c.add_argument("--engine", choices=("tunix", "vllm"), default="tunix",
                   help="tunix (default): logits of Tunix and transformers; vllm: serve HF_DIR (a merged export, "
                        "or a PEFT adapter on --base) on vLLM and compare its greedy continuations and top-5 "
                        "logprobs with transformers (+ peft) and, with --lora, Tunix; exit 1 naming the first "
                        "prompt and position that differ")
    c.add_argument("--vllm-python", help="the python of a venv with vLLM (default $GEMPORT_VLLM_PYTHON, else this "
                                         "one; `make vllm` creates .venv-vllm)")
    c.add_argument("--prompts", type=int, default=Default("gemport.check.verify.compare_vllm", "num_prompts"),
                   help="--engine vllm: random prompts of --seq-len tokens (default %(default)s)")
    c.add_argument("--max-tokens", type=int, default=Default("gemport.check.verify.compare_vllm", "max_tokens"),
                   help="--engine vllm: tokens generated per prompt (default %(default)s)")
    c.add_argument("--dtype", default=Default("gemport.check.verify.compare_vllm", "dtype"), choices=("float32", "bfloat16"),
                   help="float32 or bfloat16 (default %(default)s). --engine tunix: Tunix and transformers both "
                        "load in it, judged against its floor; --engine vllm: vLLM's dtype (the references "
                        "compute in float32, judged against the floor of transformers in that dtype)")
    c.set_defaults(run=verify)

    c = sub.add_parser("peft-for-vllm", help="a PEFT adapter made elsewhere -> one vLLM serves exactly",
                       description="Copy a PEFT adapter (e.g. trained with PEFT on GPUs), adding on Gemma 4's k_eq_v "
                                   "layers (V is K) k_proj's factors under v_proj's name: vLLM applies k_proj's LoRA "
                                   "to K only, transformers + PEFT to K and V. PEFT ignores the copies; everything "
                                   "else is copied byte for byte.")
    c.add_argument("adapter", help="the PEFT adapter directory")
    c.add_argument("model", help=f"the base it adapts: {model_help}")
    c.add_argument("out", help="the output directory (must not exist)")
    c.set_defaults(run=peft_for_vllm)

    c = sub.add_parser("parity", help="the GPU recipe (TRL + PEFT) and the port, step by step, on CPU",
                       description="Train N steps of the recipe with TRL's SFTTrainer + PEFT on torch and with "
                                   "Tunix + gemport.step from the same step-0 adapter, on CPU (float32, or the "
                                   "recipe's bfloat16 with --dtype), and print lr, loss and grad_norm of both per "
                                   "step, each as N x the floor measured in the same run (the GPU recipe trained "
                                   "again, in float64 or, for --dtype bfloat16, in float32). Exit status 1 on a "
                                   "disagreement beyond 10 x the floor (or --rtol), naming the first step and "
                                   "quantity.")
    c.add_argument("base", help="an HF Gemma checkpoint (or a miniature of it) with its tokenizer")
    c.add_argument("data", help="a sample of the training data (.jsonl/.json/.parquet, TRL's formats)")
    c.add_argument("--config", required=True, help="the recipe: YAML/JSON of SFTConfig fields, as `trl sft --config` "
                                                    "(with --trainer dpo: a `trl dpo --config` YAML)")
    c.add_argument("--trainer", choices=("sft", "dpo"), default="sft",
                   help="the recipe's TRL trainer: sft (default; SFTTrainer against gemport sft's step) or dpo "
                        "(DPOTrainer against gemport dpo's step, judging TRL's DPO metrics too: every quantity "
                        "against 10 x its step's floor unless --rtol fixes a bound; the segment step only; "
                        "docs/dpo.md)")
    c.add_argument("--lora-config", help="PEFT adapter_config.json (default: lora_* fields of --config)")
    c.add_argument("--port-config", help="the port's recipe (SFTConfig; DPOConfig with --trainer dpo), if it differs "
                                         "from --config")
    c.add_argument("--steps", type=int, help="optimizer steps (default: max_steps of --config)")
    c.add_argument("--rtol", type=float,
                   help="a fixed relative tolerance on loss and grad_norm, instead of the default: 10 x each "
                        "step's floor, how far the GPU recipe logs them from its own run in float64 (with --dtype "
                        "bfloat16: its bfloat16 run from its float32 one), at least one float32 unit. Each step is "
                        "printed as N x its floor either way")
    c.add_argument("--adapter-rtol", type=float,
                   help="a fixed relative tolerance on each module's final s*B@A (default: 10 x the floor measured "
                        "by the GPU recipe's second run and, in float32, the port's again with more padding; at "
                        "least 5e-4)")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="float32 (default): both sides in float32, a disagreement is in what is computed; bfloat16: "
                        "the recipe as bf16 trains it (TRL under torch's CPU bfloat16 autocast on a bfloat16 base, "
                        "the port on a bfloat16 base; LoRA factors float32 on both), judged against the floor of "
                        "the GPU recipe's own float32 run")
    c.add_argument("--loss", choices=("segment", "tunix"), default="segment",
                   help="the port's loss function: segment (default), segment attention and chunked cross-entropy, "
                        "as gemport trains (step.segment_loss); tunix, Tunix's own attention and logits "
                        "(step.tunix_loss)")
    c.add_argument("--miniature", action="store_true",
                   help="run on a random miniature of BASE's architecture (6 layers, narrow, same heads and "
                        "pattern) instead of its weights; BASE needs only config.json and the tokenizer")
    c.add_argument("--vocab-size", type=int, help="the miniature's vocabulary (default: BASE's, so its tokenizer fits)")
    c.add_argument("--out", default="gemport-parity", metavar="DIR",
                   help="where parity.json (every figure) and parity.png (loss and grad_norm per step of both sides, "
                        "their relative differences against the tolerances) go (default %(default)s)")
    c.set_defaults(run=parity)

    add_sft_parser(sub)
    add_dpo_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, args.extra = p.parse_known_args(argv)
    if args.extra and not getattr(args, "overrides", False):  # only `gemport sft` / `dpo` take --key value overrides
        p.error(f"unrecognized arguments: {' '.join(args.extra)}")
    try:
        return args.run(args)
    except GemportError as e:
        print(f"gemport {args.command}: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"gemport {args.command}: error: {e.filename or e}: no such file or directory", file=sys.stderr)
        return 2
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""
        print(f"gemport {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

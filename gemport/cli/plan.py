"""``gemport plan MODEL --tpu SLICE``: every valid (fsdp, tp) mesh for a model and what each device holds."""

from __future__ import annotations

import os

from gemport.cli.common import MODEL_HELP, Default, given, lora_spec_of, spec_of
from gemport.errors import LoraError, MeshError


def add_parser(sub) -> None:
    """Register ``gemport plan`` on the ``gemport`` subparsers."""
    c = sub.add_parser("plan", help="valid (fsdp, tp) meshes and per-device memory for a model",
                       description="List every valid (fsdp, tp) mesh for a model on N devices with what each "
                                   "device holds: base params, LoRA params, Adam moments.")
    c.add_argument("model", help=MODEL_HELP)
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
                   help="remat of the step: Tunix's remat_config in lower case (none, block, decoder), or "
                        "projections (decoder remat keeping the adapted projections' products) "
                        "(default %(default)s)")
    c.add_argument("--compile", action="store_true",
                   help="also lower and compile the LoRA train step for abstract inputs, for --tpu's chips or else "
                        "this host's CPU (nothing allocated; a minute or more at real widths), and print its "
                        "compiled peak per device")
    c.set_defaults(run=run)


def run(args) -> int:
    """``gemport plan``: print the valid meshes (and with ``--compile`` each one's compiled peak); exit status 0."""
    # Lazy: these load JAX, and --help stays cheap.
    import jax  # lazy: --help stays cheap

    from gemport.lora import LoraSpec, QLoraSpec  # lazy: JAX; --help stays cheap
    from gemport.mesh import TpuSlice  # lazy: JAX; --help stays cheap
    from gemport.plan import valid_meshes  # lazy: JAX; --help stays cheap
    from gemport.plan.compiled import CPU_MEMORY_SCHEDULER  # lazy: JAX; --help stays cheap

    if args.lora_rank is not None and args.lora_rank < 1:
        raise LoraError(f"--lora-rank {args.lora_rank}: a LoRA rank is a positive integer (omit it for full "
                        "fine-tuning)")
    spec = spec_of(args.model)
    hbm = int(args.hbm) if args.hbm and args.hbm.isdigit() else args.hbm
    devices = args.devices
    if args.tpu:
        tpu = TpuSlice.parse(args.tpu)
        if args.devices not in (None, tpu.chips):
            raise MeshError(f"--devices {args.devices} disagrees with --tpu {tpu.name}, which has {tpu.chips} chips; "
                            "give one of them")
        devices, hbm = tpu.chips, hbm or tpu.generation
    elif devices is None:
        raise MeshError("give the slice: --tpu (e.g. v5p-8) or --devices (its chip count)")
    if (args.batch is None) != (args.seq_len is None):
        raise MeshError("plan the train step with both --batch and --seq-len, or neither")
    lora = lora_spec_of(args.lora_config)
    if lora is None and args.lora_rank is not None:
        lora = LoraSpec(args.lora_rank)  # alpha scales the delta, not its memory
    qlora = None
    if args.qlora:
        qlora = QLoraSpec(qtype=args.qlora, double_quant=args.double_quant)
        if lora is None:
            raise LoraError("--qlora trains LoRA on the 4-bit base: give --lora-rank or --lora-config")
    if args.compile and "JAX_PLATFORMS" not in os.environ:
        # Compiling needs no accelerator, and a plan must not take (or wait for) the one a run may hold.
        jax.config.update("jax_platforms", "cpu")
    if args.compile and not args.tpu:
        # Read when JAX's CPU backend starts: in a fresh process, before anything has run.
        flags = os.environ.get("XLA_FLAGS", "")
        if "host_platform_device_count" not in flags:
            flags += f" --xla_force_host_platform_device_count={devices}"
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_MEMORY_SCHEDULER}".strip()
    plans = valid_meshes(spec, devices, hbm_bytes=hbm, lora_spec=lora, batch=args.batch, seq_len=args.seq_len,
                         qlora=qlora, **given(args, param_dtype="param_dtype", remat="remat"))
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
    from gemport.plan import compiled_peak  # lazy: JAX; --help stays cheap

    if lora is None or args.batch is None:
        raise MeshError("--compile compiles the LoRA train step: give --lora-rank or --lora-config, --batch and "
                        "--seq-len")
    try:
        peak = compiled_peak(spec, lora, p.fsdp, p.tp, batch=args.batch, seq_len=args.seq_len, qlora=qlora,
                             tpu=args.tpu, remat=p.step.remat, **given(args, param_dtype="param_dtype"))
    except MeshError as e:
        return f"not compiled: {e}"
    compiler = f"TPU {args.tpu}, libtpu's compiler" if args.tpu else "XLA:CPU"
    return f"compiled peak ({compiler}, the step SFTRun.train() runs): {peak / 2**30:.2f} GiB ({peak} bytes) per device"


__all__ = ["add_parser", "run"]

"""``gemport export BASE LORA OUT``: LoRA trained with Tunix as merged HF safetensors or a PEFT adapter."""

from __future__ import annotations

from gemport.cli.common import Default, add_lora_source, check_out, given, lora_spec_of


def add_parser(sub) -> None:
    """Register ``gemport export`` on the ``gemport`` subparsers."""
    c = sub.add_parser("export", help="Orbax LoRA -> merged HF safetensors or a PEFT adapter",
                       description="Export LoRA params trained with Tunix (a PeftTrainer checkpoint) for the GPU "
                                   "world: merged into the base (for vLLM) or as a PEFT adapter.")
    c.add_argument("base", help="the HF checkpoint the adapter was trained on")
    c.add_argument("lora", help="the PeftTrainer checkpoint root, a step, or a model_params directory")
    c.add_argument("out", help="the output directory (must not exist)")
    c.add_argument("--format", choices=("merged", "peft"), default="merged", help="default merged")
    add_lora_source(c, "checkpoint")
    c.add_argument("--base-model-name", help="base_model_name_or_path for the PEFT adapter (default: base path)")
    c.add_argument("--max-shard-size", default=Default("gemport.checkpoint.export_merged", "max_shard_size"),
                   help="merged shard size (default %(default)s)")
    c.set_defaults(run=run)


def run(args) -> int:
    """``gemport export``: write the merged checkpoint or the PEFT adapter to ``args.out``; exit status 0."""
    from gemport.checkpoint import export_merged, export_peft  # lazy: JAX; --help stays cheap

    check_out(args)
    lora_spec = lora_spec_of(args.lora_config)
    if args.format == "merged":
        out = export_merged(args.lora, args.out, base_dir=args.base, lora_spec=lora_spec, step=args.step,
                            **given(args, max_shard_size="max_shard_size"))
    else:
        out = export_peft(args.lora, args.out, base_dir=args.base, lora_spec=lora_spec, step=args.step,
                          base_model_name_or_path=args.base_model_name)
    print(f"wrote {out}")
    return 0


__all__ = ["add_parser", "run"]

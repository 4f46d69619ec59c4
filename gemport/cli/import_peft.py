"""``gemport import-peft ADAPTER MODEL OUT``: a PEFT adapter trained on GPUs as Qwix LoRA params for Tunix."""

from __future__ import annotations

from gemport.cli.common import MODEL_HELP, check_out, spec_of


def add_parser(sub) -> None:
    """Register ``gemport import-peft`` on the ``gemport`` subparsers."""
    c = sub.add_parser("import-peft", help="a PEFT adapter -> Orbax LoRA params for Tunix",
                       description="Read a PEFT LoRA adapter trained on GPUs as Qwix LoRA params, saved as a "
                                   "PeftTrainer-style checkpoint (<out>/0/model_params) with its LoRA spec.")
    c.add_argument("adapter", help="the PEFT adapter directory")
    c.add_argument("model", help=MODEL_HELP)
    c.add_argument("out", help="the output checkpoint root (must not exist)")
    c.set_defaults(run=run)


def run(args) -> int:
    """``gemport import-peft``: write the LoRA checkpoint (step 0) to ``args.out``; exit status 0."""
    from gemport.checkpoint import import_peft as read_adapter  # lazy: JAX; --help stays cheap
    from gemport.checkpoint import save_lora  # lazy: JAX; --help stays cheap

    check_out(args)
    lora = read_adapter(args.adapter, spec=spec_of(args.model))
    out = save_lora(lora, args.out)
    spec = lora.lora_spec
    print(f"wrote {out} (step 0, rank {spec.rank}, alpha {spec.alpha}, fused {spec.fused})")
    return 0


__all__ = ["add_parser", "run"]

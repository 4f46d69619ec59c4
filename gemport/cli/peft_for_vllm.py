"""``gemport peft-for-vllm ADAPTER MODEL OUT``: a PEFT adapter made elsewhere, rewritten so vLLM serves it
exactly."""

from __future__ import annotations

from gemport.cli.common import MODEL_HELP, check_out, spec_of


def add_parser(sub) -> None:
    """Register ``gemport peft-for-vllm`` on the ``gemport`` subparsers."""
    c = sub.add_parser("peft-for-vllm", help="a PEFT adapter made elsewhere -> one vLLM serves exactly",
                       description="Copy a PEFT adapter (e.g. trained with PEFT on GPUs), adding on Gemma 4's k_eq_v "
                                   "layers (V is K) k_proj's factors under v_proj's name: vLLM applies k_proj's LoRA "
                                   "to K only, transformers + PEFT to K and V. PEFT ignores the copies; everything "
                                   "else is copied byte for byte.")
    c.add_argument("adapter", help="the PEFT adapter directory")
    c.add_argument("model", help=f"the base it adapts: {MODEL_HELP}")
    c.add_argument("out", help="the output directory (must not exist)")
    c.set_defaults(run=run)


def run(args) -> int:
    """``gemport peft-for-vllm``: write the rewritten adapter to ``args.out``; exit status 0."""
    from gemport.checkpoint import peft_for_vllm as rewrite  # lazy: JAX; --help stays cheap

    check_out(args)
    out, added = rewrite(args.adapter, args.out, spec=spec_of(args.model))
    print(f"wrote {out} (" + (f"v_proj copies of k_proj on {len(added)} k_eq_v layers: {', '.join(added)}"
                              if added else "vLLM serves it as it was: nothing added") + ")")
    return 0


__all__ = ["add_parser", "run"]

"""``gemport parity BASE DATA --config recipe.yaml``: the GPU recipe (TRL + PEFT) and the port, step by step, on
CPU, each quantity judged against a floor measured in the same run."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from gemport import recipe as trl_recipe
from gemport._src.extras import require
from gemport.errors import RecipeError


def add_parser(sub) -> None:
    """Register ``gemport parity`` on the ``gemport`` subparsers."""
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
                        "by the GPU recipe's second run and, for SFT in float32, the port's again with more "
                        "padding; at least 5e-4)")
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
    c.set_defaults(run=run)


def run(args) -> int:
    """``gemport parity``: the trainer's comparison (checked whole first), on the base or its miniature;
    parity.json and parity.png in ``--out``, the table printed. Exit status 1 on a disagreement."""
    for peer in ("torch", "transformers", "peft", "trl", "datasets"):  # the GPU side, checked before anything else
        require(peer, "gemport parity's GPU side (TRL + PEFT on torch)", extra="parity")
    # Lazy: these load JAX, and --help stays cheap.
    from gemport.check.parity import miniature  # lazy: JAX; --help stays cheap
    from gemport.check.plots import write_parity  # lazy: JAX; --help stays cheap

    compare = (dpo_comparison if args.trainer == "dpo" else sft_comparison)(args)  # before anything trains
    with tempfile.TemporaryDirectory(prefix="gemport-miniature-") as work:
        base, tokenizer = args.base, None
        if args.miniature:
            import transformers  # optional: the hf extra

            tokenizer = transformers.AutoTokenizer.from_pretrained(args.base)
            base = miniature(args.base, Path(work) / "miniature", vocab_size=args.vocab_size)
            print(f"miniature of {args.base}: {base}")
        report = compare(base, tokenizer)
    numbers, picture = write_parity(report, args.out)
    print(f"wrote {numbers}" + (f", {picture}" if picture else
                                 " (parity.png needs matplotlib: pip install 'gemport[plot]')"))
    print(report.table())
    return 0 if report.ok else 1


def sft_comparison(args):
    """The SFT recipe's comparison, ``(base, tokenizer) -> parity.Trajectory``, its recipe read and checked."""
    # Lazy: these load JAX, and --help stays cheap.
    from gemport.check.frame import dropout_note, without_dropout  # lazy: JAX; --help stays cheap
    from gemport.check.parity import read_recipe, trajectory  # lazy: JAX; --help stays cheap
    from gemport.check.verdict import Tolerances  # lazy: JAX; --help stays cheap
    from gemport.step import segment_loss, tunix_loss  # lazy: JAX; --help stays cheap

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


def dpo_comparison(args):
    """``gemport parity BASE DATA --config dpo.yaml --trainer dpo``'s comparison, its recipe read and checked
    before anything trains: ``(base, tokenizer) -> DPOTrajectory``, TRL's DPOTrainer + PEFT against ``gemport
    dpo``'s step (``gemport.check.dpo_parity.trajectory``), judged per step against the floors measured in the run."""
    # Lazy: these load JAX, and --help stays cheap.
    from gemport.check.dpo_parity import FLOORS, trajectory  # lazy: JAX; --help stays cheap
    from gemport.check.frame import dropout_note, without_dropout  # lazy: JAX; --help stays cheap
    from gemport.check.verdict import Tolerances  # lazy: JAX; --help stays cheap

    # Checked before anything loads: what this comparison does not run.
    if args.loss != "segment":
        raise RecipeError(f"--loss {args.loss}: gemport dpo trains with the segment step only (segment attention, "
                          "chunked log-probabilities); drop --loss")
    recipe = trl_recipe.read(args.config, command="dpo")
    config = recipe.sft
    for note in recipe.notes:
        print(f"  {note}")
    lora = args.lora_config or recipe.lora()
    if not lora:
        raise RecipeError(f"{args.config}: use_peft is not set; set use_peft with lora_r and lora_target_modules, "
                          "or pass --lora-config adapter_config.json")
    if config["disable_dropout"]:  # TRL's default: every dropout module's p set to 0, LoRA's included
        dropout = without_dropout(lora)[1]
        if dropout:
            print(f"lora_dropout={dropout}: TRL's disable_dropout (default true) trains without it, and so does "
                  "gemport dpo: compared as both train, without dropout")
    else:
        lora, dropout = without_dropout(lora)
        if dropout:
            print(dropout_note(dropout))
    port = None
    if args.port_config:
        port_recipe = trl_recipe.read(args.port_config, command="dpo")
        if port_recipe.lora() not in (None, recipe.lora()):
            raise RecipeError(f"{args.port_config}: its lora_* fields differ from {args.config}'s; both sides start "
                              "from one adapter, the recipe's: give the port's DPOConfig fields only")
        port = port_recipe.sft
    if config["bf16"] and args.dtype == "float32":
        print(f"{args.config} trains in bfloat16 (bf16, TRL's default): compared in float32, where a disagreement is "
              "in what is computed; --dtype bfloat16 compares it in bfloat16, against the bfloat16 floor")
    tolerances = FLOORS if args.rtol is None else Tolerances(loss=args.rtol, grad_norm=args.rtol)
    tolerances = dataclasses.replace(tolerances, adapter=args.adapter_rtol)
    return lambda base, tokenizer: trajectory(base, args.data, dpo_config=config, lora_config=lora,
                                              steps=args.steps, tokenizer=tokenizer, port_dpo_config=port,
                                              tolerances=tolerances, qlora=recipe.qlora(), dtype=args.dtype)


__all__ = ["add_parser", "dpo_comparison", "run", "sft_comparison"]

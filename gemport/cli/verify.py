"""``gemport verify HF_DIR``: transformers' and Tunix's logits (or vLLM's continuations) on the same tokens, judged
against a floor measured on them."""

from __future__ import annotations

from pathlib import Path

from gemport._src.extras import require
from gemport.cli.common import Default, add_lora_source, given, lora_spec_of, spec_of
from gemport.errors import CheckpointError


def add_parser(sub) -> None:
    """Register ``gemport verify`` on the ``gemport`` subparsers."""
    c = sub.add_parser("verify", help="compare Tunix and transformers logits",
                       description="Run the same tokens through transformers and Tunix and report the largest "
                                   "logit difference. HF_DIR alone: the checkpoint against its Tunix load. With "
                                   "--base and --lora: an export (merged dir or PEFT adapter) against Tunix "
                                   "with the LoRA. The distance is judged against a floor measured on the same tokens "
                                   "(N x the floor); exit status 1 when they disagree beyond --within (or --atol).")
    c.add_argument("hf_dir", help="an HF checkpoint, a merged export, or a PEFT adapter")
    c.add_argument("--base", help="the base HF checkpoint (for an export or an adapter)")
    c.add_argument("--lora", help="the Orbax LoRA checkpoint the export came from")
    add_lora_source(c, "--lora checkpoint")
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
    c.set_defaults(run=run)


def run(args) -> int:
    """``gemport verify``: print the report(s); exit status 1 when they disagree."""
    for peer in ("torch", "transformers"):  # transformers' logits, the reference, checked before anything loads
        require(peer, "gemport verify's reference (transformers on torch)", extra="hf")
    # Lazy: these load JAX, and --help stays cheap.
    from gemport.check.verify import compare_logits  # lazy: JAX; --help stays cheap
    from gemport.checkpoint import load_lora, load_model  # lazy: JAX; --help stays cheap
    from gemport.lora import apply_lora  # lazy: JAX; --help stays cheap

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
        spec = spec_of(str(base))
        lora = load_lora(args.lora, lora_spec=lora_spec_of(args.lora_config), step=args.step)
        model = apply_lora(load_model(base, spec=spec, param_dtype=tunix_dtype), spec, lora)
    elif args.engine == "vllm":
        model = None
    else:
        model = load_model(hf_dir, param_dtype=tunix_dtype)
    if args.engine == "vllm":
        return _verify_vllm(args, hf_dir, adapter, model)
    report = compare_logits(hf_dir, model, adapter_dir=adapter, dtype=dtype,
                            **given(args, seq_len="seq_len", within="within", atol="atol"))
    print(report)
    return 0 if report.ok else 1


def _verify_vllm(args, hf_dir: Path, adapter: Path | None, tunix_model) -> int:
    """``--engine vllm``: ``hf_dir`` (``adapter`` on it, if given) served on vLLM against transformers and, given,
    ``tunix_model``; each report printed, 1 when any disagrees."""
    # Lazy: these load JAX, and --help stays cheap.
    from gemport.check.verify import compare_vllm  # lazy: JAX; --help stays cheap
    from gemport.checkpoint import vllm_misserved  # lazy: JAX; --help stays cheap

    misserved = vllm_misserved(adapter, spec=spec_of(str(hf_dir))) if adapter else []
    if misserved:
        print(f"vLLM serves V without k_proj's delta on the k_eq_v layers of {', '.join(misserved)} (no v_proj "
              f"copy; transformers + PEFT give V that delta): `gemport peft-for-vllm {adapter} {hf_dir} OUT` writes "
              "the adapter vLLM serves exactly")
    reports = compare_vllm(hf_dir, adapter_dir=adapter, tunix_model=tunix_model, python=args.vllm_python,
                           **given(args, num_prompts="prompts", seq_len="seq_len", max_tokens="max_tokens",
                                    within="within", atol="atol", dtype="dtype"))
    for report in reports:
        print(report)
    return 0 if all(r.ok for r in reports) else 1


__all__ = ["add_parser", "run"]

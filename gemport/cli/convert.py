"""``gemport convert SRC OUT``: HF safetensors to an Orbax checkpoint of the Tunix parameters, or back."""

from __future__ import annotations

from pathlib import Path

from gemport.cli.common import MODEL_HELP, Default, check_out, given, spec_of
from gemport.errors import CheckpointError, SpecError


def add_parser(sub) -> None:
    """Register ``gemport convert`` on the ``gemport`` subparsers."""
    c = sub.add_parser("convert", help="HF safetensors <-> Orbax Tunix parameters",
                       description="An HF checkpoint directory becomes an Orbax checkpoint of the Tunix "
                                   "parameters; an Orbax checkpoint becomes HF safetensors.")
    c.add_argument("src", help="an HF checkpoint directory, or an Orbax checkpoint")
    c.add_argument("out", help="the output directory (must not exist)")
    c.add_argument("--spec", help=f"for Orbax -> HF: {MODEL_HELP}")
    c.add_argument("--base-dir", help="for Orbax -> HF: the original HF checkpoint (keeps its layout and files)")
    c.add_argument("--param-dtype", help="parameter dtype, e.g. bfloat16 (default: keep)")
    c.add_argument("--max-shard-size", default=Default("gemport.checkpoint.save_hf", "max_shard_size"),
                   help="HF shard size (default %(default)s)")
    c.set_defaults(run=run)


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


def run(args) -> int:
    """``gemport convert``: write the converted checkpoint to ``args.out``; exit status 0."""
    from gemport.checkpoint import load_hf, load_orbax, save_hf, save_orbax  # lazy: JAX; --help stays cheap

    src = Path(args.src)
    check_out(args)
    if _kind(src) == "hf":
        out = save_orbax(load_hf(src, param_dtype=args.param_dtype), args.out)
    else:
        if not (args.spec or args.base_dir):
            raise SpecError(f"{src} is an Orbax checkpoint: pass --spec (HF dir or preset) or --base-dir")
        spec = spec_of(args.spec or args.base_dir)
        out = save_hf(load_orbax(src, spec=spec, param_dtype=args.param_dtype), args.out, base_dir=args.base_dir,
                      spec=spec, **given(args, max_shard_size="max_shard_size"))
    print(f"wrote {out}")
    return 0


__all__ = ["add_parser", "run"]

"""The ``gemport`` command line: a thin layer over the library. ``gemport COMMAND --help`` for each command."""

from __future__ import annotations

import argparse
import sys

from gemport.cli import convert, dpo, export, import_peft, parity, peft_for_vllm, plan, sft, verify
from gemport.errors import GemportError

COMMANDS = (plan, convert, export, import_peft, verify, peft_for_vllm, parity, sft, dpo)
"""The command modules, in the order ``gemport --help`` lists them: each registers its subparser (``add_parser``),
whose ``run`` default runs it."""


def parser() -> argparse.ArgumentParser:
    """The ``gemport`` parser: one subparser per command of ``COMMANDS``."""
    p = argparse.ArgumentParser(prog="gemport", description="Port Gemma LoRA fine-tuning between HF and Tunix.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``gemport`` with ``argv`` (default: the process's arguments).

    Returns:
      The command's exit status; 2 on a ``GemportError`` or a file error, printed as one line naming the command.
    """
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

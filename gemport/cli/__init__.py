"""The ``gemport`` command line: a thin layer over the library, one module per command."""

from gemport.cli.main import main

__all__ = ["main"]

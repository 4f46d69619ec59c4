"""Where things are, for a test at any depth of tests/: the repository, these helpers (with the scripts tests run
as subprocesses) and the fixture files."""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
TESTS = HELPERS.parent
ROOT = TESTS.parent
FILES = TESTS / "files"

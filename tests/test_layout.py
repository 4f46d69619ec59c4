"""The tests mirror the tree: the tests of each stage of gemport (``gemport/<stage>/``) in ``tests/<stage>/``, the
package-wide ones here; what tests share lives in one place, ``tests/helpers/`` (on pytest's ``pythonpath``) and the
fixtures of ``conftest.py``, so no test module imports another (fixture files: ``tests/files/``)."""

import ast
import collections
import importlib.machinery
import re
import sys
from pathlib import Path

import gemport

PACKAGE = Path(gemport.__file__).parent
TESTS = Path(__file__).parent
HELPERS = TESTS / "helpers"
# An import of a test module, also inside a script a test runs as a subprocess (a string).
IMPORTS_A_TEST = re.compile(r"^\s*(?:from|import)\s+(?:test_\w+|conftest)\b", re.MULTILINE)


def sources():
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_stage_has_a_tests_folder_and_every_tests_folder_a_stage():
    stages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file() and not p.name.startswith("_")}
    folders = {p.parent.name for p in TESTS.glob("*/*.py")} - {HELPERS.name}
    tested = {p.parent.name for p in TESTS.glob("*/test_*.py")}
    assert not stages - tested, f"stages of gemport/ without tests in tests/<stage>/: {sorted(stages - tested)}"
    assert not folders - stages, f"folders of tests/ that are no stage of gemport/: {sorted(folders - stages)}"
    assert not list(HELPERS.glob("test_*.py")), "tests/helpers/ holds helpers, not tests"


def test_no_test_module_imports_another():
    """A test module's names come from gemport, the helpers or a fixture, never from another test module (nor from
    a conftest: pytest hands fixtures to tests by name)."""
    found = []
    for path in sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [m.group().split()[-1] for m in IMPORTS_A_TEST.finditer(node.value)]
            found += [f"{path.relative_to(TESTS)}:{node.lineno}: {name}" for name in names
                      if name.split(".")[0].startswith("test_") or name.split(".")[0] == "conftest"]
    assert not found, "test modules imported (move what is shared to tests/helpers/ or a conftest fixture):\n" + (
        "\n".join(found))


def test_test_modules_have_unique_names():
    """pytest imports a test module by its file name (the default rootdir import mode, no __init__.py)."""
    counts = collections.Counter(p.name for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)
    assert not [name for name, n in counts.items() if n > 1], sorted(
        str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if counts[p.name] > 1)


def test_helpers_shadow_no_installed_module():
    """A helper is imported by its bare name, first on sys.path: one named as a package (``tokenizers``) or a
    standard module would hide it from every import in the test process."""
    elsewhere = [p for p in sys.path if Path(p or ".").resolve() not in (HELPERS.resolve(), TESTS.resolve())]
    shadowing = []
    for path in HELPERS.glob("*.py"):
        name = path.stem
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        if name in sys.stdlib_module_names or name in sys.builtin_module_names or (spec and spec.origin):
            shadowing.append(name)
    assert not shadowing, f"helpers named as installed or standard modules: {shadowing}"

"""Imports point down the stages: each of gemport's stage packages imports only the stages before it, counting
imports inside functions (a lazy import is still a dependency); imports for type checkers only (``if
TYPE_CHECKING:``) are not dependencies."""

import ast
from pathlib import Path

import gemport

ROOT = Path(gemport.__file__).parent


def _unit(module: str) -> str:
    # gemport.run.sft -> gemport.run; gemport.cli.main -> gemport.cli
    return ".".join(module.split(".")[:2])


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module == "gemport":  # the lazy namespace re-exports everything
            continue
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolved against this module's package
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if base == "gemport" else base for a in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("gemport.") and _unit(target) != _unit(module):
                    edges.setdefault(_unit(module), set()).add(_unit(target))
    return edges


def _cycle(edges):
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


STAGES = ("errors", "_src", "specs", "lora", "recipe", "checkpoint", "mesh", "data", "optim", "step", "run", "plan",
          "check", "cli")
"""gemport's units in the order a port flows through them (``gemport._SUBMODULES``' order, after the shared errors
and internals): each may import only those before it."""


def test_every_unit_is_a_stage_in_the_order_of_the_pipeline():
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert units - {"__init__", "__main__"} == set(STAGES)
    assert gemport._SUBMODULES == STAGES[2:]


def test_imports_point_down_the_stages():
    edges = _graph()
    rank = {f"gemport.{s}": i for i, s in enumerate(STAGES)}
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() if a in rank for b in targets if rank[b] >= rank[a])
    assert upward == []
    assert "gemport.run" in edges["gemport.plan"]  # planning sits above training
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_an_upward_import_is_found():
    edges = {"gemport.data": {"gemport.run"}}
    rank = {f"gemport.{s}": i for i, s in enumerate(STAGES)}
    assert [f"{a} -> {b}" for a, targets in edges.items() for b in targets if rank[b] >= rank[a]] == [
        "gemport.data -> gemport.run"]


def test_a_circle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]


# Upstream privates (Tunix's, Qwix's) are touched in gemport._src.upstream only; gemport's own private names stay in
# their package.
UPSTREAM = "gemport/_src/upstream.py"
_NAMEDTUPLE = {"_asdict", "_fields", "_make", "_replace"}  # public API of namedtuples despite the underscore


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _privacy(sources: dict[str, str]) -> list[str]:
    """What in ``sources`` ({path under the repo: text}) breaks the rules above, one line each."""
    trees = {path: ast.parse(text) for path, text in sources.items()}
    defined = set(_NAMEDTUPLE)  # private names gemport itself gives (upstream.py's assignments are upstream's)
    for path, tree in trees.items():
        if path == UPSTREAM:
            continue
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(n.name)
            elif isinstance(n, ast.arg):
                defined.add(n.arg)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                defined.add(n.attr)
            elif isinstance(n, ast.alias):
                defined.add((n.asname or n.name).split(".")[0])
            elif isinstance(n, ast.keyword) and n.arg:
                defined.add(n.arg)
    found = []
    for path, tree in trees.items():
        parts = Path(path).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module:
                top = n.module.split(".")[0]
                names = [a.name for a in n.names]
                if top in ("tunix", "qwix") and path != UPSTREAM and (
                        any(_private(p) for p in n.module.split(".")) or any(map(_private, names))):
                    found.append(f"{path}:{n.lineno}: imports {n.module} ({', '.join(names)})")
                if top == "gemport" and _unit(n.module) != _unit(module):
                    found += [f"{path}:{n.lineno}: imports {n.module}.{a}" for a in names if _private(a)]
            elif isinstance(n, ast.Import):
                found += [f"{path}:{n.lineno}: imports {a.name}" for a in n.names
                          if a.name.split(".")[0] in ("tunix", "qwix") and path != UPSTREAM
                          and any(_private(p) for p in a.name.split("."))]
            elif (isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in defined
                  and path != UPSTREAM):
                found.append(f"{path}:{n.lineno}: reads .{n.attr}, a private name gemport does not define")
    return found


def test_upstream_privates_are_touched_in_one_module_and_no_private_name_crosses_packages():
    sources = {str(p.relative_to(ROOT.parent)): p.read_text() for p in ROOT.rglob("*.py")}
    assert UPSTREAM in sources
    assert _privacy(sources) == []


def test_the_privacy_rules_find_what_they_forbid():
    found = _privacy({
        UPSTREAM: "from qwix._src.core import qarray\ntrainer._pbar.close()\n",
        "gemport/lora/x.py": "from qwix._src.providers import ptq\nimport tunix._private\n",
        "gemport/train/y.py": "from gemport.data.formats import _tools\nfrom gemport.train.z import _ok\n"
                              "trainer._mode\nself._own = 1\nself._own\nrow._replace(a=1)\n",
    })
    assert [f.split(":")[0] + ":" + f.split(":")[1] for f in found] == [
        "gemport/lora/x.py:1", "gemport/lora/x.py:2", "gemport/train/y.py:1", "gemport/train/y.py:3"], found


def test_subclasses_of_upstream_classes_override_no_upstream_private():
    """gemport's Tunix trainer and Qwix provider override public hooks of ``gemport._src.upstream``'s bases, never
    a private method of Tunix's or Qwix's classes."""
    from gemport.lora.qwix import Provider
    from gemport.run.trainer import HFPeftTrainer

    for cls, upstream_base in ((HFPeftTrainer, HFPeftTrainer.__mro__[2]), (Provider, Provider.__mro__[2])):
        assert upstream_base.__module__.split(".")[0] in ("tunix", "qwix"), cls.__mro__
        overridden = [name for name in vars(cls) if _private(name) and hasattr(upstream_base, name)]
        assert overridden == [], (cls, overridden)


def _bare_lazy_imports(sources: dict[str, str]) -> list[str]:
    """The imports inside functions of ``sources`` ({path: text}) with no comment on their line(s) saying why."""
    found = []
    for path, text in sources.items():
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(fn):
                    if (isinstance(n, (ast.Import, ast.ImportFrom))
                            and "#" not in "\n".join(lines[n.lineno - 1:n.end_lineno])):
                        found.append(f"{path}:{n.lineno}: {ast.unparse(n)}")
    return sorted(set(found))


def test_every_import_inside_a_function_says_why():
    """Imports sit at the top of a module, except where an optional dependency, a cycle or a cheap ``--help`` needs
    otherwise, each such import saying why in a comment on its line (``# optional: torch``, ``# cycle: ...``)."""
    sources = {str(p.relative_to(ROOT.parent)): p.read_text() for p in ROOT.rglob("*.py")}
    assert _bare_lazy_imports(sources) == []


def test_a_bare_lazy_import_is_found():
    found = _bare_lazy_imports({"gemport/x.py": "import os\n\ndef f():\n    import torch  # optional: torch\n"
                                                "    from gemport import lora\n    return lora\n"})
    assert found == ["gemport/x.py:5: from gemport import lora"]

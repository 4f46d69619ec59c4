"""Imports point down: no two of gemport's packages (or top-level modules) import each other, directly or around
a circle, counting imports inside functions (a lazy import is still a dependency); imports for type checkers only
(``if TYPE_CHECKING:``) are not dependencies."""

import ast
from pathlib import Path

import gemport

ROOT = Path(gemport.__file__).parent


def _unit(module: str) -> str:
    # gemport.train.run -> gemport.train; gemport.cli -> gemport.cli
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


def test_no_import_circle_between_packages():
    edges = _graph()
    assert "gemport.train" in edges and "gemport.plan" in edges
    assert "gemport.train" in edges["gemport.plan"]  # planning sits above training
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_a_circle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]

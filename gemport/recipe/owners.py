"""The defaults of TRL's and transformers' config dataclasses, recorded from the owners themselves.

A field's default belongs to its owner (``OWNERS``: TRL's ``ScriptArguments``, ``ModelConfig``, ``SFTConfig``,
``DPOConfig``; transformers' ``TrainingArguments``). gemport reads it from ``defaults.json`` beside this module,
a table generated from the installed owners with their versions (``python -m gemport.recipe`` writes it anew
for a new TRL or transformers), so that a host without TRL (a TPU VM needs no torch) reads the same defaults
as one with it. Where the owner is installed at another version than the one recorded, its own defaults are
read and followed, and any that differ from the recorded ones are named once in a ``DefaultsWarning``; never
silently. ``tests/recipe/test_owners.py`` fails when the table and the installed owners disagree.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import importlib.metadata
import json
import sys
import warnings
from pathlib import Path
from typing import Any

from gemport.errors import DefaultsWarning, MissingDependencyError

OWNERS = {"ScriptArguments": "trl", "ModelConfig": "trl", "SFTConfig": "trl", "DPOConfig": "trl",
          "TrainingArguments": "transformers"}
"""Each owner dataclass and the package it belongs to (``gemport[trl]``, ``gemport[hf]``)."""

TABLE = Path(__file__).with_name("defaults.json")
"""The recorded table: ``{owner: {"package", "version", "defaults": {field: default}}}``."""

_EXTRAS = {"trl": "trl", "transformers": "hf"}


class _Absent:
    def __repr__(self):
        return "absent"


_ABSENT = _Absent()


def owner_class(owner: str) -> type:
    """The owner dataclass named ``owner`` (a key of ``OWNERS``), imported from TRL or transformers.

    Raises:
      MissingDependencyError: its package is not installed; names the extra to install.
    """
    package = OWNERS[owner]
    try:
        return getattr(importlib.import_module(package), owner)
    except ImportError:
        raise MissingDependencyError(f"{owner} is {package}'s, which is not installed: "
                                     f"pip install 'gemport[{_EXTRAS[package]}]'") from None


def class_defaults(cls: type) -> dict[str, Any]:
    """The defaults of dataclass ``cls`` (TRL's ``SFTConfig``, ``DPOConfig``...): {field name: default}, each
    field with a default or a default factory (called)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def installed_version(package: str) -> str | None:
    """``package``'s installed version, or None when it is not installed (read from its metadata: nothing is
    imported)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _json(value: Any) -> Any:
    # The table's reading of a default (enums by value, tuples as lists), so a recorded default compares with an
    # installed one.
    return json.loads(json.dumps(value, default=lambda v: getattr(v, "value", str(v))))


def record() -> dict[str, dict[str, Any]]:
    """The table of the installed owners: ``{owner: {"package", "version", "defaults"}}`` for every owner.

    Raises:
      MissingDependencyError: TRL or transformers is not installed.
    """
    return {owner: {"package": package, "version": installed_version(package),
                    "defaults": _json(class_defaults(owner_class(owner)))} for owner, package in OWNERS.items()}


@functools.cache
def recorded() -> dict[str, dict[str, Any]]:
    """The recorded table (``TABLE``), read once."""
    return json.loads(TABLE.read_text())


def differences(owner: str, installed: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{field: (recorded default, installed default)} of each field of ``owner`` whose installed default (in
    ``installed``, ``class_defaults`` of the installed class) differs from the recorded one, or that only one of
    them has."""
    table = recorded()[owner]["defaults"]
    plain = _json(installed)
    return {name: (table.get(name, _ABSENT), plain.get(name, _ABSENT)) for name in sorted({*table, *plain})
            if table.get(name, _ABSENT) != plain.get(name, _ABSENT)}


@functools.cache
def _defaults(owner: str) -> dict[str, Any]:
    entry = recorded()[owner]
    version = installed_version(entry["package"])
    if version is None or version == entry["version"]:
        return entry["defaults"]
    installed = class_defaults(owner_class(owner))
    changed = differences(owner, installed)
    if changed:
        shown = ", ".join(f"{name} ({old!r} -> {new!r})" for name, (old, new) in list(changed.items())[:8])
        warnings.warn(f"{entry['package']} {version} is installed and gemport recorded {owner}'s defaults from "
                      f"{entry['version']}; {len(changed)} differ: {shown}{' ...' if len(changed) > 8 else ''}. "
                      f"gemport follows the installed {entry['package']} (python -m gemport.recipe records "
                      "it)", DefaultsWarning, stacklevel=3)
    return installed


def defaults(owner: str) -> dict[str, Any]:
    """{field: default} of the owner dataclass ``owner`` (a key of ``OWNERS``): the recorded table's, or the
    installed owner's where its version differs from the recorded one (a ``DefaultsWarning`` names the defaults
    that differ). A new copy each call; needs neither TRL nor transformers installed.

    Example:
      >>> from gemport.recipe import defaults
      >>> defaults("SFTConfig")["max_length"], defaults("ModelConfig")["lora_r"]
      (1024, 16)
    """
    return copy.deepcopy(_defaults(owner))


def main(argv: list[str] | None = None) -> int:
    """``python -m gemport.recipe [PATH]``: write the table of the installed owners to ``PATH`` (default
    ``TABLE``), atomically."""
    path = Path((argv if argv is not None else sys.argv[1:])[0]) if (argv or sys.argv[1:]) else TABLE
    table = record()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    print(f"wrote {path}: " + ", ".join(f"{o} ({e['package']} {e['version']}, {len(e['defaults'])} fields)"
                                       for o, e in table.items()))
    return 0


__all__ = ["OWNERS", "TABLE", "class_defaults", "defaults", "differences", "installed_version", "main",
           "owner_class", "record", "recorded"]

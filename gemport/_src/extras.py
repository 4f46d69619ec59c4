"""Optional dependencies, imported where a feature needs them, with the pip command that installs them."""

from __future__ import annotations

import importlib
from types import ModuleType

from gemport.errors import MissingDependencyError

_INSTALL = {
    "tunix": "pip install 'gemport[tunix]'",
    "grain": "pip install 'gemport[tunix]'",
    "torch": "pip install 'gemport[hf]'",
    "transformers": "pip install 'gemport[hf]'",
    "peft": "pip install 'gemport[hf]'",
    "trl": "pip install 'gemport[parity]'",
    "datasets": "pip install 'gemport[parity]'",
    "pyarrow": "pip install pyarrow",
    "matplotlib": "pip install 'gemport[plot]'",
}


def require(module: str, purpose: str, *, extra: str | None = None) -> ModuleType:
    """``importlib.import_module(module)``, or `MissingDependencyError` saying that ``purpose`` needs it and how
    to install it: ``pip install 'gemport[extra]'`` when ``extra`` names the feature's extra, else the module's."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        how = f"pip install 'gemport[{extra}]'" if extra else _INSTALL.get(top, f"pip install {top}")
        raise MissingDependencyError(f"{purpose} needs {top}, which is not installed ({e}); {how}") from None


__all__ = [
    "require",
]

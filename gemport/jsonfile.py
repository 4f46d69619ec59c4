"""Reading the small JSON files of a checkpoint or adapter directory, with typed errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path, name: str, error: type[Exception], what: str) -> Any:
    """The parsed JSON of ``path``, or of ``path / name`` when ``path`` is a directory.

    Raises ``error`` naming the file when it is missing (saying to pass ``what``) or not valid JSON.
    """
    path = Path(path)
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise error(f"{path}: no {name} here; pass {what}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None

"""The small JSON inputs of gemport (``config.json``, safetensors indexes, ``adapter_config.json``,
``gemport_lora.json``, PEFT config dicts): read and checked field by field, with typed errors.

Every malformed value, whatever its kind (a list where an object belongs, a string where a number does, a
null shard, a non-UTF-8 file), becomes the caller's error class naming the file (or source) and the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_REQUIRED = object()


def kind(value: Any) -> str:
    """The JSON name of a value's type, for messages: ``object``, ``array``, ``string``, ``number``..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, (list, tuple)) else "object" if isinstance(value, Mapping) else type(value).__name__


def read_json(path: str | Path, name: str, error: type[Exception], what: str) -> dict[str, Any]:
    """The JSON object in ``path``, or in ``path / name`` when ``path`` is a directory.

    Raises ``error`` naming the file when it is missing (saying to pass ``what``), not UTF-8, not valid
    JSON, or holds something other than an object.
    """
    path = Path(path)
    if path.is_dir():
        path = path / name
    if not path.is_file():
        raise error(f"{path}: no {name} here; pass {what}")
    try:
        data = json.loads(path.read_bytes())
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); write it again as UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: holds a JSON {kind(data)}, not an object; is this the right file?")
    return data


class Fields:
    """A JSON object's fields, each checked as it is read.

    An absent field and an explicit ``null`` are the same: the default, or an error for a required field.
    Wrong types and out-of-range values raise ``error`` naming ``source`` and the field.
    """

    def __init__(self, data: Any, source: str, error: type[Exception]):
        if not isinstance(data, Mapping):
            raise error(f"{source}: expected a JSON object, got a {kind(data)} ({data!r:.80})")
        self.data, self.source, self.error = data, source, error

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None and default is _REQUIRED:
            raise self.error(f"{self.source}: {key!r} is missing, and it is required")
        return value

    def fail(self, key: str, value: Any, expected: str):
        raise self.error(f"{self.source}: {key}={value!r:.80} is not {expected}")

    def integer(self, key: str, default: Any = _REQUIRED, *, minimum: int | None = 1) -> Any:
        """An int (an integral float such as ``8.0`` counts; ``true`` does not) of at least ``minimum``."""
        value = self._get(key, default)
        if value is None:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, value, "an integer")
        if minimum is not None and value < minimum:
            self.fail(key, value, f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: Any = _REQUIRED, *, minimum: float | None = None,
               below: float | None = None) -> Any:
        """A finite number in ``[minimum, below)``."""
        value = self._get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(key, value, "a finite number")
        if (minimum is not None and value < minimum) or (below is not None and value >= below):
            bounds = " and ".join(b for b in (minimum is not None and f">= {minimum}",
                                              below is not None and f"< {below}") if b)
            self.fail(key, value, f"a number {bounds}")
        return float(value)

    def _typed(self, key: str, default: Any, ok: Any, expected: str, convert: Any = None) -> Any:
        # The field (``convert``ed), or the default where absent; ``expected`` names what fails ``ok``.
        value = self._get(key, default)
        if value is None:
            return default
        if not ok(value):
            self.fail(key, value, expected)
        return value if convert is None else convert(value)

    def boolean(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._typed(key, default, lambda v: isinstance(v, bool), "true or false")

    def string(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._typed(key, default, lambda v: isinstance(v, str), "a string")

    def strings(self, key: str, default: Any = _REQUIRED) -> Any:
        """A list of strings."""
        return self._typed(key, default, lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
                           "a list of strings", list)

    def mapping(self, key: str, default: Any = _REQUIRED) -> Any:
        """A JSON object, as a plain dict."""
        return self._typed(key, default, lambda v: isinstance(v, Mapping), "a JSON object", dict)

    def fields(self, key: str) -> Fields:
        """The object in field ``key`` (absent: empty), with ``source`` extended by the key."""
        return Fields(self.mapping(key, {}), f"{self.source} {key}", self.error)


__all__ = [
    "Fields",
    "kind",
    "read_json",
]

"""String options as ``typing.Literal`` types, checked where a user passes them.

The ``Literal`` is the one list of allowed values: type checkers read it, and ``one_of`` reads it at run
time with ``typing.get_args``, so the error message and the annotation cannot disagree.
"""

import typing
from typing import Any

from gemport.errors import GemportError


def one_of(value: Any, options: Any, field: str, error: type[GemportError]) -> Any:
    """Returns ``value`` when it is one of the values of the ``Literal`` type ``options``.

    Otherwise raises ``error`` naming ``field`` and the allowed values. A bool is never an allowed
    value (``True == 1`` would pass for an int ``Literal``; ``thinking=True`` is a former spelling).
    """
    allowed = typing.get_args(options)
    if isinstance(value, bool) or value not in allowed:
        raise error(f"{field}: {value!r} is not one of {allowed}")
    return value

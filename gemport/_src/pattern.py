"""Layout strings and einsum equations, parsed once.

A layout is an einops pattern such as ``"s (k h) d -> s k d h"``: each side lists the dimensions of an array,
and a dimension is one axis letter or a parenthesised group of letters merged into one. ``Pattern.parse``
turns the string into that structure; the names table (``gemport.specs.names``), the LoRA factor layouts
(``gemport.lora``) and the mesh's dimension names (``gemport.mesh``) all read layouts through it. An einsum equation such as ``"BTD,NDH->BTNH"`` (one letter per
dimension, as Tunix's modules record them) is read by ``Equation.parse``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping

from gemport.errors import SpecError

Dim = tuple[str, ...]
"""One array dimension: the axis letters it merges, e.g. ``("k", "h")`` for ``(k h)``, ``("d",)`` for ``d``."""

_TOKEN = re.compile(r"\(([^()]*)\)|(\w+)|(\S)")


@dataclasses.dataclass(frozen=True)
class Pattern:
    """An einops pattern ``left -> right``; each side a tuple of dimensions (``Dim``).

    E.g. ``Pattern.parse("s (k h) d -> s k d h")`` has ``left == (("s",), ("k", "h"), ("d",))`` and
    ``right == (("s",), ("k",), ("d",), ("h",))``. A pattern without ``->`` has only ``left``.
    """

    text: str
    left: tuple[Dim, ...]
    right: tuple[Dim, ...] = ()

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def parse(text: str) -> Pattern:
        """Parse ``text``; ``SpecError`` naming it when it is not a pattern of letters and groups."""
        sides = text.split("->")
        if len(sides) > 2:
            raise SpecError(f"layout {text!r}: more than one '->'")
        return Pattern(text, *(_side(text, side) for side in sides))

    @property
    def letters(self) -> frozenset[str]:
        """Every axis letter on either side."""
        return frozenset(a for dim in self.left + self.right for a in dim)

    def sizes_for(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """The entries of ``sizes`` that this pattern's letters use (what ``einops.rearrange`` accepts)."""
        return {a: n for a, n in sizes.items() if a in self.letters}

    @property
    def inverse(self) -> str:
        """The pattern read backwards, ``right -> left``: ``"s k d h -> s (k h) d"``."""
        left, right = self.text.split("->")
        return f"{right.strip()} -> {left.strip()}"


@dataclasses.dataclass(frozen=True)
class Equation:
    """An einsum equation: each operand's axis letters and the output's.

    E.g. ``Equation.parse("BTD,NDH->BTNH")`` has ``inputs == ("BTD", "NDH")`` and ``output == "BTNH"``.
    """

    text: str
    inputs: tuple[str, ...]
    output: str

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def parse(text: str) -> Equation:
        """Parse ``text``; ``SpecError`` naming it when it has no single ``->``."""
        lhs, *out = text.replace(" ", "").split("->")
        if len(out) != 1:
            raise SpecError(f"einsum {text!r}: an equation has exactly one '->'")
        return Equation(text, tuple(lhs.split(",")), out[0])

    @property
    def letters(self) -> frozenset[str]:
        """Every axis letter the equation uses."""
        return frozenset("".join(self.inputs) + self.output)


def shape(dims: tuple[Dim, ...], sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The array shape ``dims`` describe: each dimension the product of its axes' sizes."""
    return tuple(math.prod(sizes[a] for a in dim) for dim in dims)


def words(dims: tuple[Dim, ...]) -> tuple[str, ...]:
    """Each dimension as a word: its letters joined, e.g. ``("s", "kh", "d")``."""
    return tuple("".join(dim) for dim in dims)


def _side(text: str, side: str) -> tuple[Dim, ...]:
    dims = []
    for group, name, other in _TOKEN.findall(side):
        if other:
            raise SpecError(f"layout {text!r}: unexpected {other!r}; a layout is axis letters and (groups)")
        dims.append(tuple(group.split()) if group else (name,))
    return tuple(dims)


__all__ = [
    "Dim",
    "Equation",
    "Pattern",
    "shape",
    "words",
]

"""Partition-spec arithmetic shared by the sharding audit, the LoRA fixer and the memory plan.

A spec is a tuple with one entry per array dimension: ``None`` (replicated), an axis name, or a tuple of
axis names. Tunix writes them as plain tuples in each ``nnx.Param``'s ``out_sharding`` metadata.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from jax.sharding import NamedSharding, PartitionSpec

Spec = tuple


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes one spec entry shards over: ``None`` -> (), ``"tp"`` -> ("tp",), tuples as they are."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def spec_of(var) -> Spec:
    """The ``out_sharding`` annotation of an ``nnx.Variable`` as a tuple; () when it has none."""
    return tuple(var.get_metadata().get("out_sharding") or ())


def named_sharding(var, mesh) -> NamedSharding:
    """``var``'s annotation placed on ``mesh`` (replicated where it has none)."""
    return NamedSharding(mesh, PartitionSpec(*spec_of(var)))


def padded(spec: Spec, ndim: int) -> Spec:
    """``spec`` with trailing ``None`` up to ``ndim`` entries (a spec may be shorter than the rank)."""
    return tuple(spec) + (None,) * (ndim - len(spec))


def shards(entry, axis_sizes: Mapping[str, int]) -> int:
    """Into how many pieces one spec entry splits its dimension."""
    return math.prod(axis_sizes[a] for a in axes_of(entry))


def bytes_per_device(shape: Sequence[int], spec: Spec, axis_sizes: Mapping[str, int], itemsize: int) -> int:
    """Bytes one device holds of an array of ``shape`` placed with ``spec``.

    An indivisible dimension is counted as JAX pads it: each device holds ``ceil(size / shards)``.
    """
    spec = padded(spec, len(shape))
    return itemsize * math.prod(-(-size // shards(entry, axis_sizes)) for size, entry in zip(shape, spec))


__all__ = [
    "Spec",
    "axes_of",
    "bytes_per_device",
    "named_sharding",
    "padded",
    "shards",
    "spec_of",
]

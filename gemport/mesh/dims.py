"""The dimensions each mesh axis shards, read from the Tunix model's own annotations.

Tunix annotates every Gemma parameter with a spec over the axes ``fsdp`` and ``tp`` (e.g. ``q_einsum``
(N, D, H) -> ("tp", "fsdp", None)). Building the model as shapes only (``nnx.eval_shape``) gives every
parameter's shape and spec for any spec, without memory; the ``gemport.specs.names`` layouts name each axis.
"""

from __future__ import annotations

import dataclasses
import functools
import re

from flax import nnx

from gemport.specs import names
from gemport._src import pattern
from gemport._src.params import abstract_model, path_str
from gemport._src.partition import axes_of, spec_of
from gemport.specs import GemmaSpec

FSDP, TP = "fsdp", "tp"

@dataclasses.dataclass(frozen=True)
class ShardedDim:
    """A dimension (size and meaning) that a mesh axis shards, and where it occurs.

    Attributes:
      axis: ``"fsdp"`` or ``"tp"``.
      dim: its meaning, e.g. ``"KV heads"``.
      size: its length, e.g. 4.
      layers: the layers whose parameters have it (empty for embeddings and the final norm).
      params: Tunix paths of the parameters that shard it along ``axis``.
      where: ``layers`` in words, e.g. ``"the global layers 5, 11, 17, ..."``.
    """

    axis: str
    dim: str
    size: int
    layers: tuple[int, ...]
    params: tuple[str, ...]
    where: str

    def __str__(self):
        shown = ", ".join(self.params[:2]) + (", ..." if len(self.params) > 2 else "")
        return f"{self.dim} = {self.size} in {self.where} ({shown})"


def _layer_of(path: str) -> int | None:
    m = re.match(r"layers\.(\d+)\.", path)
    return int(m.group(1)) if m else None


def _numbers(layers) -> str:
    shown = list(layers) if len(layers) <= 8 else [*layers[:6], "...", layers[-1]]
    return ", ".join(map(str, shown))


def _where(spec: GemmaSpec, layers: tuple[int, ...], params: tuple[str, ...]) -> str:
    if not layers:
        return ", ".join(params)
    if len(layers) == spec.num_layers:
        return "every layer"
    for kind in ("sliding", "global"):
        if layers == spec.layers_of(kind):
            return f"the {kind} layers {_numbers(layers)}"
    return f"layers {_numbers(layers)}"


@functools.lru_cache(maxsize=16)
def annotated(spec: GemmaSpec):
    """(path, shape, spec, entry) of every Tunix parameter, from Tunix's own model built as shapes only."""
    model = abstract_model(spec)
    by_path = {e.tunix: e for e in names.entries(spec)}
    return tuple(
        (path_str(p), tuple(v.get_value().shape), spec_of(v), by_path[path_str(p)])
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    )


@functools.lru_cache(maxsize=16)
def sharded_dims(spec: GemmaSpec) -> tuple[ShardedDim, ...]:
    """Every (axis, dimension) pair Tunix's default annotations shard, for ``spec``'s shapes.

    E.g. for ``gemma4-31b``: tp shards query heads = 32 (every layer), KV heads = 16 (sliding layers),
    KV heads = 4 (global layers, through ``k_einsum``), head widths 256 and 512 (the Q/K norms), model width
    5376 (norms), MLP width 21504 and vocabulary 262144; fsdp shards model width 5376.
    """
    groups: dict[tuple[str, str, int], tuple[set, list]] = {}
    for path, shape, ann, entry in annotated(spec):
        for size, letter, entry_axes in zip(shape, pattern.words(entry.pattern.right), ann):
            for axis in axes_of(entry_axes):
                layers, params = groups.setdefault((axis, names.AXES[letter], size), (set(), []))
                layer = _layer_of(path)
                if layer is not None:
                    layers.add(layer)
                params.append(path)
    dims = []
    for (axis, dim, size), (layers, params) in groups.items():
        layers = tuple(sorted(layers))
        dims.append(ShardedDim(axis, dim, size, layers, tuple(params), _where(spec, layers, tuple(params))))
    return tuple(dims)


def misfits(spec: GemmaSpec, sizes: dict[str, int]) -> list[ShardedDim]:
    """The sharded dimensions that their axis' size in ``sizes`` (e.g. {"fsdp": 2, "tp": 8}) does not divide."""
    return [d for d in sharded_dims(spec) if d.size % sizes.get(d.axis, 1)]

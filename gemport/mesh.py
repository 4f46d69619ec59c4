"""Meshes that fit the model, and what each device will hold on them.

Tunix annotates every Gemma parameter with a spec over the axes ``fsdp`` and ``tp`` (e.g. ``q_einsum``
(N, D, H) -> ("tp", "fsdp", None)). A mesh fits when every dimension an axis shards divides by that axis'
size. ``sharded_dims`` lists those dimensions, read from the annotations of the Tunix model itself (built
abstractly), named with the ``gemport.names`` axis letters; ``make_mesh`` and ``valid_meshes`` check against
it, and ``memory_plan`` sums the per-device bytes of the same annotated shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from gemport import names
from gemport.checkpoint.load import path_str
from gemport.errors import MeshError
from gemport.sharding import lora_shapes, lora_specs
from gemport.sharding._specs import axes_of, bytes_per_device, spec_of
from gemport.sharding.lora import LINEAR_EQUATION
from gemport.specs import GemmaSpec

__all__ = [
    "HBM",
    "LORA_TARGETS",
    "MemoryPlan",
    "MeshError",
    "ShardedDim",
    "make_mesh",
    "memory_plan",
    "sharded_dims",
    "valid_meshes",
    "valid_tp",
]

GiB = 2**30

# HBM per chip (one JAX device), from Google Cloud's TPU system architecture pages.
HBM = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}

# Qwix module_path regex (matched against "/"-joined module paths): every attention and MLP projection.
LORA_TARGETS = r".*/(q_einsum|kv_einsum|k_einsum|qkv_einsum|attn_vec_einsum|gate_proj|up_proj|down_proj)"

FSDP, TP = "fsdp", "tp"

_DIM_NAMES = {
    "d": "model width", "f": "MLP width", "n": "query heads", "k": "KV heads", "h": "head width",
    "v": "vocabulary", "l": "layers", "p": "per-layer input width", "e": "experts", "i": "expert width",
    "g": "gate/up", "s": "stacked K/V", "o": "layer scalar",
}  # fmt: skip


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


def _layout_letters(layout: str) -> list[str]:
    side = layout.split("->")[1]
    return ["".join(group.split()) or name for group, name in re.findall(r"\(([^)]*)\)|(\w+)", side)]


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


def _abstract_model(spec: GemmaSpec):
    def build():
        # RNG counters held as refs: updating a plain traced counter makes flax query the tracer's sharding,
        # and JAX's error text for that walks the whole trace; gemma4-31b then takes 10 s instead of 1.5 s.
        with nnx.var_defaults(ref=True):
            rngs = nnx.Rngs(0)
        return spec.tunix_model_class()(spec.to_tunix(), rngs=rngs)

    return nnx.eval_shape(build)


@functools.lru_cache(maxsize=16)
def _annotated(spec: GemmaSpec):
    """(path, shape, spec, entry) of every Tunix parameter, and (match path, weight path, shape, spec,
    equation) of every module LoRA can target: all from Tunix's own model, built as shapes only."""
    model = _abstract_model(spec)
    by_path = {e.tunix: e for e in names.entries(spec)}
    params = tuple(
        (path_str(p), tuple(v.get_value().shape), spec_of(v), by_path[path_str(p)])
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    )
    modules = []
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear):
            weight, equation = "kernel", LINEAR_EQUATION
        elif isinstance(getattr(module, "einsum_str", None), str):
            weight, equation = "w", module.einsum_str
        else:
            continue
        var = getattr(module, weight)
        shape = tuple(var.get_value().shape)
        modules.append(("/".join(map(str, path)), f"{path_str(path)}.{weight}", shape, spec_of(var), equation))
    return params, tuple(modules)


@functools.lru_cache(maxsize=16)
def sharded_dims(spec: GemmaSpec) -> tuple[ShardedDim, ...]:
    """Every (axis, dimension) pair Tunix's default annotations shard, for ``spec``'s shapes.

    E.g. for ``gemma4-31b``: tp shards query heads = 32 (every layer), KV heads = 16 (sliding layers),
    KV heads = 4 (global layers, through ``k_einsum``), head widths 256 and 512 (the Q/K norms), model width
    5376 (norms), MLP width 21504 and vocabulary 262144; fsdp shards model width 5376.
    """
    groups: dict[tuple[str, str, int], tuple[set, list]] = {}
    for path, shape, ann, entry in _annotated(spec)[0]:
        for size, letter, entry_axes in zip(shape, _layout_letters(entry.layout), ann):
            for axis in axes_of(entry_axes):
                layers, params = groups.setdefault((axis, _DIM_NAMES.get(letter, letter), size), (set(), []))
                layer = _layer_of(path)
                if layer is not None:
                    layers.add(layer)
                params.append(path)
    return tuple(
        ShardedDim(axis, dim, size, tuple(sorted(layers)), tuple(params), _where(spec, tuple(sorted(layers)), tuple(params)))
        for (axis, dim, size), (layers, params) in groups.items()
    )


def _misfits(spec: GemmaSpec, sizes: dict[str, int]) -> list[ShardedDim]:
    return [d for d in sharded_dims(spec) if d.size % sizes.get(d.axis, 1)]


def valid_tp(spec: GemmaSpec, num_devices: int) -> list[int]:
    """The tp sizes for which (fsdp = num_devices // tp, tp) fits ``spec``, ascending."""
    return [
        tp
        for tp in range(1, num_devices + 1)
        if num_devices % tp == 0 and not _misfits(spec, {FSDP: num_devices // tp, TP: tp})
    ]


def _check(spec: GemmaSpec, fsdp: int, tp: int) -> None:
    bad = _misfits(spec, {FSDP: fsdp, TP: tp})
    if not bad:
        return
    n = fsdp * tp
    lines = [f"{d.axis}={fsdp if d.axis == FSDP else tp} does not divide {d}" for d in bad]
    tps = valid_tp(spec, n)
    pairs = ", ".join(f"fsdp={n // t} tp={t}" for t in tps)
    raise MeshError(
        f"mesh fsdp={fsdp} x tp={tp} does not fit this {spec.family} model ({spec.num_layers} layers, "
        f"hidden {spec.hidden}):\n  " + "\n  ".join(lines) + f"\nvalid tp on {n} devices: {tps} ({pairs}); "
        "pass one of these, or a device count that the dimensions above divide"
    )


def _sizes(spec: GemmaSpec, n: int, fsdp: int | None, tp: int | None) -> tuple[int, int]:
    if fsdp is None and tp is None:
        tps = valid_tp(spec, n)
        if not tps:
            raise MeshError(f"no (fsdp, tp) with fsdp * tp = {n} fits this model; use another device count")
        tp = tps[-1]
    if tp is None:
        tp = n // fsdp
    if fsdp is None:
        fsdp = n // tp
    if fsdp * tp != n:
        raise MeshError(
            f"fsdp={fsdp} x tp={tp} = {fsdp * tp} devices, but {n} are given; "
            f"pick sizes whose product is {n}, or pass devices= with {fsdp * tp} devices"
        )
    return fsdp, tp


def make_mesh(
    spec: GemmaSpec,
    *,
    fsdp: int | None = None,
    tp: int | None = None,
    devices=None,
    axis_names: tuple[str, str] = (FSDP, TP),
) -> Mesh:
    """A 2-D ``(fsdp, tp)`` mesh with Auto axes over ``devices``, checked against ``spec`` first.

    Unset sizes are chosen: without both, the largest tp that fits and fsdp = devices // tp. Devices that
    span several slices (multi-slice, DCN) get a hybrid mesh with the slices along fsdp, so tp (and its
    frequent collectives) stays inside a slice's ICI; multi-host single slices use JAX's topology-aware order.

    Args:
      spec: the architecture, e.g. ``GemmaSpec.preset("gemma4-31b")``.
      fsdp, tp: axis sizes; their product must be the device count.
      devices: default ``jax.devices()`` (all processes' devices).
      axis_names: names of the two axes; Tunix's annotations use ``("fsdp", "tp")``.

    Raises:
      MeshError: an axis does not divide a dimension it shards (each named with its size, layers and
        params, with the valid tp sizes), or the sizes do not multiply to the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    fsdp, tp = _sizes(spec, len(devices), fsdp, tp)
    _check(spec, fsdp, tp)
    axis_types = (AxisType.Auto, AxisType.Auto)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices == 1:
        return jax.make_mesh((fsdp, tp), axis_names, axis_types, devices=devices)
    if fsdp % slices:
        raise MeshError(
            f"fsdp={fsdp} does not divide by the {slices} slices the devices span; fsdp runs across slices, "
            f"so pick an fsdp that is a multiple of {slices}"
        )
    grid = mesh_utils.create_hybrid_device_mesh((fsdp // slices, tp), (slices, 1), devices)
    return Mesh(grid, axis_names, axis_types=axis_types)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes each device holds for one (fsdp, tp) mesh, before activations.

    Attributes:
      fsdp, tp: the mesh.
      base_bytes: the model's params under Tunix's annotations.
      lora_bytes: lora_a and lora_b of every target module (0 for full fine-tuning).
      optimizer_bytes: Adam's mu and nu for the trainable params (LoRA, or all params without LoRA).
      hbm_bytes: HBM per device, if given.
    """

    fsdp: int
    tp: int
    base_bytes: int
    lora_bytes: int
    optimizer_bytes: int
    hbm_bytes: int | None = None

    @property
    def total_bytes(self) -> int:
        return self.base_bytes + self.lora_bytes + self.optimizer_bytes

    @property
    def fits(self) -> bool | None:
        """Whether ``total_bytes`` fits ``hbm_bytes`` (None without it). Activations and gradients need room too."""
        return None if self.hbm_bytes is None else self.total_bytes <= self.hbm_bytes

    def __str__(self):
        gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        text = (
            f"fsdp={self.fsdp} tp={self.tp}: base {gib(self.base_bytes)} + LoRA {gib(self.lora_bytes)} + "
            f"Adam mu,nu {gib(self.optimizer_bytes)} = {gib(self.total_bytes)} per device"
        )
        if self.hbm_bytes is None:
            return text
        return text + f" of {gib(self.hbm_bytes)}: " + ("fits" if self.fits else "does not fit")


def _hbm(hbm_bytes: int | str | None) -> int | None:
    if isinstance(hbm_bytes, str):
        try:
            return HBM[hbm_bytes]
        except KeyError:
            raise MeshError(f"unknown chip {hbm_bytes!r}; known: {', '.join(HBM)}; or pass bytes") from None
    return hbm_bytes


def memory_plan(
    spec: GemmaSpec,
    fsdp: int,
    tp: int,
    *,
    lora_rank: int | None = None,
    hbm_bytes: int | str | None = None,
    param_dtype="bfloat16",
    lora_dtype=None,
    moments_dtype=None,
    targets: str = LORA_TARGETS,
) -> MemoryPlan:
    """Per-device bytes of params, LoRA params and Adam moments on an (fsdp, tp) mesh.

    Every array counts ``prod(shape) / prod(sizes of the axes its spec shards)`` elements: base params
    with their Tunix annotations, LoRA factors with the specs ``gemport.sharding.lora_specs`` derives
    (Qwix creates them in the base weight's dtype) for each module whose "/"-joined path fully matches
    ``targets`` (K/V of KV-shared layers excluded: they never run, so Qwix adds nothing there). Adam keeps
    mu and nu, each shaped and sharded like the trainable params, in ``moments_dtype`` (default: the
    trainable params' dtype, as ``optax.adamw`` does).

    Args:
      lora_rank: LoRA rank r; None plans full fine-tuning (moments for every param, no LoRA).
      hbm_bytes: HBM per device in bytes, or a chip name from ``HBM`` (e.g. ``"v5p"``).
    """
    _check(spec, fsdp, tp)
    sizes = {FSDP: fsdp, TP: tp}
    params, modules = _annotated(spec)
    # Tunix creates every parameter in param_dtype, so elements per device times one itemsize is exact.
    base_elements = sum(bytes_per_device(shape, ann, sizes, 1) for _, shape, ann, _ in params)
    trainable_dtype = np.dtype(param_dtype)
    lora_elements = 0
    if lora_rank is not None:
        trainable_dtype = np.dtype(lora_dtype or param_dtype)
        unused = {e.tunix for *_, e in params if e.fill is not None}
        for match_path, weight, shape, ann, equation in modules:
            if weight in unused or not re.fullmatch(targets, match_path):
                continue
            parts = zip(lora_shapes(shape, equation, lora_rank), lora_specs(ann, len(shape), equation))
            lora_elements += sum(bytes_per_device(s, p, sizes, 1) for s, p in parts)
    trainable = lora_elements if lora_rank is not None else base_elements
    moments_item = np.dtype(moments_dtype or trainable_dtype).itemsize
    return MemoryPlan(
        fsdp,
        tp,
        base_elements * np.dtype(param_dtype).itemsize,
        lora_elements * trainable_dtype.itemsize,
        2 * trainable * moments_item,
        _hbm(hbm_bytes),
    )


def valid_meshes(
    spec: GemmaSpec,
    num_devices: int,
    *,
    hbm_bytes: int | str | None = None,
    lora_rank: int | None = None,
    param_dtype="bfloat16",
    lora_dtype=None,
    moments_dtype=None,
    targets: str = LORA_TARGETS,
) -> tuple[MemoryPlan, ...]:
    """A ``MemoryPlan`` for every (fsdp, tp) with fsdp * tp = ``num_devices`` that fits ``spec``, by tp.

    E.g. ``valid_meshes(GemmaSpec.preset("gemma4-31b"), 4, hbm_bytes="v5p", lora_rank=16)`` lists tp = 1, 2, 4
    with what each v5p chip holds. See ``memory_plan`` for what is counted.
    """
    return tuple(
        memory_plan(
            spec, num_devices // tp, tp, lora_rank=lora_rank, hbm_bytes=hbm_bytes, param_dtype=param_dtype,
            lora_dtype=lora_dtype, moments_dtype=moments_dtype, targets=targets,
        )
        for tp in valid_tp(spec, num_devices)
    )  # fmt: skip

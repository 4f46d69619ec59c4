"""``make_mesh``: a 2-D (fsdp, tp) mesh with Auto axes, checked against the model before it is built."""

from __future__ import annotations

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from gemport.errors import MeshError
from gemport.mesh.dims import FSDP, TP, misfits
from gemport.specs import GemmaSpec


def valid_tp(spec: GemmaSpec, num_devices: int) -> list[int]:
    """The tp sizes for which (fsdp = num_devices // tp, tp) fits ``spec``, ascending."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise MeshError(f"{num_devices!r} devices: give the number of chips, at least 1")
    return [
        tp
        for tp in range(1, num_devices + 1)
        if num_devices % tp == 0 and not misfits(spec, {FSDP: num_devices // tp, TP: tp})
    ]


def check(spec: GemmaSpec, fsdp: int, tp: int) -> None:
    bad = misfits(spec, {FSDP: fsdp, TP: tp})
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
    if n < 1:
        raise MeshError("no devices given; pass devices= with at least one device")
    for name, size in ((FSDP, fsdp), (TP, tp)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise MeshError(f"{name}={size!r}: a mesh axis size is a positive integer")
        if size is not None and n % size:
            raise MeshError(f"{name}={size} does not divide the {n} devices; pick a divisor of {n}, or pass "
                            f"devices= with a multiple of {size}")
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
) -> Mesh:
    """A 2-D mesh over ``devices`` with Auto axes ``"fsdp"`` and ``"tp"`` (the names Tunix's annotations use),
    checked against ``spec`` first.

    Unset sizes are chosen: without both, the largest tp that fits and fsdp = devices // tp. Devices that
    span several slices (multi-slice, DCN) get a hybrid mesh with the slices along fsdp, so tp (and its
    frequent collectives) stays inside a slice's ICI; multi-host single slices use JAX's topology-aware order.

    Args:
      spec: the architecture, e.g. ``GemmaSpec.preset("gemma4-31b")``.
      fsdp: size of the fsdp axis; with ``tp``, their product must be the device count.
      tp: size of the tp axis.
      devices: default ``jax.devices()`` (all processes' devices).

    Returns:
      A ``jax.sharding.Mesh`` of shape (fsdp, tp).

    Raises:
      MeshError: an axis does not divide a dimension it shards (each named with its size, layers and
        params, with the valid tp sizes), or the sizes do not multiply to the device count.

    Example:

      >>> import jax
      >>> from gemport import GemmaSpec, make_mesh
      >>> mesh = make_mesh(GemmaSpec.preset("gemma4-31b"), fsdp=1, tp=1, devices=jax.devices()[:1])
      >>> dict(mesh.shape)
      {'fsdp': 1, 'tp': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    fsdp, tp = _sizes(spec, len(devices), fsdp, tp)
    check(spec, fsdp, tp)
    axis_types = (AxisType.Auto, AxisType.Auto)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices == 1:
        return jax.make_mesh((fsdp, tp), (FSDP, TP), axis_types, devices=devices)
    if fsdp % slices:
        raise MeshError(
            f"fsdp={fsdp} does not divide by the {slices} slices the devices span; fsdp runs across slices, "
            f"so pick an fsdp that is a multiple of {slices}"
        )
    grid = mesh_utils.create_hybrid_device_mesh((fsdp // slices, tp), (slices, 1), devices)
    return Mesh(grid, (FSDP, TP), axis_types=axis_types)
